"""Speculative decoding: proposals, and their exact verification against the target."""

from loramux.engine.speculative.verify import VerifiedTokens, VerifyGroup, verify

__all__ = ["VerifiedTokens", "VerifyGroup", "verify"]
