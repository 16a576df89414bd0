"""Analysis of the IRs: the flat executor (`executor`), peak memory (`memory`),
the timed simulation (`simulate`), the blocking-exchange executor for rank
programs (`rendezvous`), and the checks (`checks`), one module per property."""
