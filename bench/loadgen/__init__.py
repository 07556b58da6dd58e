"""The one load generator: it times every token itself (`tandem-bench run|sweep`; the
router and experiment suites drive it from Python)."""
