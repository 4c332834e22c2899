"""The actors beside the engines: the policy trainer, critic, reference and reward scorer."""
