"""The one load generator: it times every token itself; the router and experiment suites
drive it from Python."""
