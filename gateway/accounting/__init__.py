"""What requests cost and may spend: the ledger (billed rows, written in groups), spend
reservations, rate limits, usage added up for the CLI, the admin API and the console, and the
alerts a key's or an organization's spend raises."""
