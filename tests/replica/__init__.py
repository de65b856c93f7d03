"""Behaviour tests of one inference replica process (``python -m inference serve``), over real HTTP."""
