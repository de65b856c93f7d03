"""The console's pages: each module here is one page (see the package docstring of ``dashboards``)."""
