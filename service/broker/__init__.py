"""Brokers: how jobs travel from the api to the workers. Two implement one interface."""
