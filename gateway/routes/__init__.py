"""The routes beside the API chains: health and the models (catalog), the Responses API's stored
responses (stored_responses) and the readiness probe (readiness)."""
