"""The long-lived process of a run: run directory, stage launch, chains, online search."""
