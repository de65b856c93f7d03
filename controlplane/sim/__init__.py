"""The what-if simulator: a discrete-event fleet that replays traces under the autoscaler's pure policies."""
