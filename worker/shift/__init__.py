"""The shift: one bounded session of a lane, the integration-branch batches it runs, the dispatch of its agents and the lease guard it serves them."""
