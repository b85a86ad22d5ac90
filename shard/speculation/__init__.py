"""Speculative decoding's drafts: prompt lookup (n-gram) and a draft model; the step verifies them."""
