"""The Dash web console; it talks to the control plane through ``controlplane.client`` only.

Where it sits: ``controlplane up`` starts it as a child process (``python -m dashboards --api URL``, the
session secret in ``$CONTROLPLANE_CONSOLE_SECRET``) on 127.0.0.1:8050. A user logs in with a name and
password; the console trades them at ``POST /api/v1/auth/login`` for a short-lived token of the user's
role and makes every API call of that browser session with it (:mod:`dashboards.session`).

Modules: ``app`` (the factory :func:`dashboards.app.create_console`), ``session`` (login, sessions, the
request guard: Host check, same-origin check on every POST, login CSRF token), ``shell`` (navigation,
live-refresh clock with a pause toggle, the banner of active faults and firing alerts, HALT ALL),
``figures`` (plotly figures and formatting), ``pages/`` (one module per page).

Adding a page (say Drills)
--------------------------
1. Create ``dashboards/pages/drills.py``; it is imported automatically (every module of
   ``dashboards.pages`` is a page, and the navigation lists pages by ``order`` then name).
2. At the top: ``dash.register_page(__name__, path="/drills", name="Drills", order=2)``.
3. Define ``layout(**_)`` returning the page's components. It runs per visit inside the user's request,
   so it may call ``session.client()`` (the user's API client) and ``session.can_operate()`` (operator or
   admin). Disable every mutating control when ``can_operate()`` is False; the API refuses anyway.
4. Live panels: ``@dash.callback(Output(...), Input(shell.REFRESH, "n_intervals"))`` (the shell's clock,
   paused by the toggle). Prefix component ids with the page's name (``drills-...``): ids are global.
5. Catch ``controlplane.client.ApiError`` in callbacks and show its message; an uncaught exception is a
   500 in the browser console (the browser tests fail on any console error).
6. Long work (a drill run, a simulation) runs in the control plane, not in a console callback: start it
   with one API call that answers an id at once, keep the id in a ``dcc.Store``, and show its progress
   from a callback on the refresh clock (``dashboards.figures.progress`` draws the bar). The page stays
   responsive and the work survives a closed browser. (Dash's background callbacks would need the
   ``multiprocess`` package, which is not installed.)
7. Need a new API call? Add a method to ``controlplane.client.ControlPlaneClient`` that returns a typed
   record (``controlplane.views``, re-exported by the client); pages read attributes, never JSON keys.
   Words shared with the control plane (trace and policy names, the autoscaler's target keys) come from
   the client too. Never import other ``controlplane`` modules here (``tests/test_layers.py``).
8. Add the page to ``PAGES`` in ``tests/dashboards/test_console.py`` (its path and a CSS selector that
   shows once it has rendered), so the browser test visits it, screenshots it and fails on any browser
   console error; test its behaviour there with the module's running control plane.
"""
