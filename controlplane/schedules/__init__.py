"""Scheduled drills: cron triggers in a time zone and the scheduler that fires them."""
