"""The control plane's side of drills: the port ``chaos.drills`` needs, the drill service, and reports."""
