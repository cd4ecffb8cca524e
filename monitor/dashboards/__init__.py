"""The operator dashboards (DESIGN §10): their reads, terminal rendering, SVG charts and the HTML report."""
