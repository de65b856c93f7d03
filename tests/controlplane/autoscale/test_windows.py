"""Cron windows (controlplane.autoscale.windows): time zones, standard cron weekdays, end crons, overlaps
refused
at load, and windows read from TOML tables with errors naming the file, key and reason."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.autoscale.config import ScheduleWindowConfig
from controlplane.autoscale.windows import active_window, parse_window, parse_windows
from controlplane.config import ConfigError, load_config

MONDAY_NOON_UTC = datetime(2026, 11, 30, 12, 0, tzinfo=UTC).timestamp()  # a Monday


# ---- cron windows -------------------------------------------------------------------------------
def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_window_follows_its_time_zone_and_standard_cron_weekdays() -> None:
    day = parse_window(ScheduleWindowConfig(name="day", cron="0 8 * * 1-5", duration_s=10 * 3600,
                                            timezone="America/New_York"))
    assert day.is_active(at("2026-11-30T13:00:00+00:00"))  # Monday 08:00 in New York
    assert not day.is_active(at("2026-11-30T12:59:00+00:00"))
    assert not day.is_active(at("2026-11-30T23:00:00+00:00"))  # 18:00 there: ended
    assert not day.is_active(at("2026-11-28T14:00:00+00:00"))  # Saturday: 1-5 is Monday..Friday
    assert day.is_active(at("2026-12-04T14:00:00+00:00"))  # Friday
    summer = at("2026-07-06T12:00:00+00:00")  # Monday, New York on daylight saving time (UTC-4)
    assert day.is_active(summer) and not day.is_active(at("2026-07-06T11:59:00+00:00"))


def test_weekdays_field_and_end_cron() -> None:
    weekend = parse_window(ScheduleWindowConfig(name="weekend", cron="0 0 * * *", end_cron="0 23 * * *",
                                                weekdays=["sat", "sun"]))
    assert weekend.is_active(at("2026-11-28T10:00:00+00:00"))  # Saturday
    assert not weekend.is_active(at("2026-11-28T23:30:00+00:00"))
    assert not weekend.is_active(at("2026-11-30T10:00:00+00:00"))  # Monday
    sunday = parse_window(ScheduleWindowConfig(name="sun", cron="0 1 * * 0", duration_s=3600))
    assert sunday.is_active(at("2026-11-29T01:30:00+00:00")) and not sunday.is_active(
        at("2026-11-30T01:30:00+00:00"))


def test_overlapping_windows_are_rejected_naming_both() -> None:
    day = ScheduleWindowConfig(name="day", cron="0 8 * * mon-fri", duration_s=10 * 3600,
                               timezone="Europe/Berlin", min_replicas=4)
    evening = ScheduleWindowConfig(name="evening", cron="0 16 * * *", end_cron="0 22 * * *", max_replicas=2)
    with pytest.raises(ValueError, match="windows 'day' and 'evening' overlap"):
        parse_windows([day, evening], now=at("2026-11-30T00:00:00+00:00"))
    night = ScheduleWindowConfig(name="night", cron="0 18 * * *", end_cron="0 8 * * *",
                                 timezone="Europe/Berlin", max_replicas=2)
    windows = parse_windows([day, night], now=at("2026-11-30T00:00:00+00:00"))  # they only touch
    assert active_window(windows, at("2026-11-30T17:00:00+00:00")) is windows[1]  # 18:00 Berlin


def test_windows_load_from_toml_tables_and_bad_ones_fail_with_file_key_and_reason(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[autoscaler]\nmax_replicas = 20\n[[autoscaler.windows]]\nname = "day"\n'
                    'cron = "0 8 * * 1-5"\nduration_s = 36000\ntimezone = "Europe/Berlin"\n'
                    'min_replicas = 20\n'
                    '[[autoscaler.windows]]\nname = "night"\ncron = "0 22 * * *"\nend_cron = "0 6 * * *"\n'
                    'max_replicas = 5\n')
    windows = load_config(good).autoscaler.windows
    bounds = [(w.name, w.min_replicas, w.max_replicas) for w in windows]
    assert bounds == [("day", 20, None), ("night", None, 5)]
    cases = {
        '[[autoscaler.windows]]\nname = "x"\ncron = "0 8 * *"\nduration_s = 60\n':
            "autoscaler.windows: window 'x': cron: '0 8 * *' must have 5 fields",
        '[[autoscaler.windows]]\nname = "x"\ncron = "0 8 * * *"\nduration_s = 60\n'
        'timezone = "Mars/Olympus"\n':
            "autoscaler.windows: window 'x': cron: '0 8 * * *' in 'Mars/Olympus'",
        '[[autoscaler.windows]]\nname = "x"\ncron = "0 8 * * *"\n':
            "autoscaler.windows: window 'x': give either duration_s > 0 or end_cron",
        '[[autoscaler.windows]]\nname = "x"\ncron = "0 8 * * *"\nduration_s = 60\nfoo = 1\n':
            "autoscaler.windows[0].foo: unknown key",
        '[autoscaler]\nwindows = [1]\n': "autoscaler.windows[0]: must be a table",
        '[[autoscaler.windows]]\nname = "x"\ncron = "0 8 * * *"\nduration_s = 60\nmin_replicas = "2"\n':
            "autoscaler.windows[0].min_replicas: must be int, got str '2'",
        '[[autoscaler.windows]]\nname = "a"\ncron = "0 * * * *"\nduration_s = 3600\n'
        '[[autoscaler.windows]]\nname = "b"\ncron = "30 * * * *"\nduration_s = 60\n':
            "autoscaler.windows: windows 'a' and 'b' overlap",
    }
    for i, (text, expected) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value).startswith(f"{path}: {expected}"), str(err.value)
