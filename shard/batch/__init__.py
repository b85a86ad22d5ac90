"""A running batch and its requests' state across steps: tokens, text so far, why each stops. No KV, no model."""
