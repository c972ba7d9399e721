"""The parts of one rank of a `Pipeline`, one concept each (see `rank.state`)."""
