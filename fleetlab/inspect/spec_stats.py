"""``SpecDecodingStats``: how many drafts the target verified and accepted, in all and by position."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Counts of an engine's verify rows, kept by watching its steps (an engine observer).

    Accepted means the target agreed, as vLLM counts it: a draft accepted after a stop token
    is counted, though the request keeps nothing past the stop.
    """

    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def on_step(self, so, result, outputs) -> None:
        """Count each row of the step that verified drafts: it gained its accepted drafts plus one."""
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            if rid not in result.sampled_token_ids:
                continue
            num_accepted = len(result.sampled_token_ids[rid]) - 1
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += num_accepted
            for counts, n in ((self.drafted_per_position, len(drafts)), (self.accepted_per_position, num_accepted)):
                counts.extend([0] * (n - len(counts)))
                counts[:n] = [c + 1 for c in counts[:n]]

    def as_dict(self) -> dict:
        """The ``LLM.stats()`` keys of speculative decoding."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_position),  # vLLM's counts, by draft position
                "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
                "spec_mean_acceptance_length": (self.num_accepted_tokens + self.num_drafts) / max(1, self.num_drafts),
                "spec_acceptance_by_position": [a / d for a, d in zip(self.accepted_per_position,
                                                                      self.drafted_per_position)]}
