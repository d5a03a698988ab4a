"""The data: a deterministic token stream, addressed by global sample index.

The corpus is generated from a seed (a sparse Markov chain over the vocabulary: learnable, so the loss
falls well below log(vocab)). Sample `g` of the run is sequence `perm_e[g mod N]` of epoch `e = g // N`,
with a per-epoch permutation from the seed. The position in the data is therefore one number, the global
index of the next sample, saved in every checkpoint; on resume, each rank takes its contiguous slice of
the next global batch at the NEW world size, so nothing is repeated or skipped when the world size changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CorpusConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_sequences: int = 4096
    branching: int = 4  # likely successors per token: the entropy floor is about log(branching)
    seed: int = 1234


class TokenStream:
    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        successors = torch.randint(cfg.vocab_size, (cfg.vocab_size, cfg.branching), generator=g)
        weights = torch.tensor([0.5 ** i for i in range(cfg.branching)])
        choice = torch.multinomial(weights, cfg.n_sequences * cfg.seq_len, replacement=True, generator=g)
        choice = choice.view(cfg.n_sequences, cfg.seq_len)
        tokens = torch.empty(cfg.n_sequences, cfg.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(cfg.vocab_size, (cfg.n_sequences,), generator=g)
        for t in range(cfg.seq_len):  # vectorised across sequences: seq_len small steps
            tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
        self.tokens = tokens
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.cfg.n_sequences, generator=g)}
        return self._perms[epoch]

    def sequences(self, sample_ids: range) -> torch.Tensor:
        n = self.cfg.n_sequences
        rows = [int(self._perm(g // n)[g % n]) for g in sample_ids]
        return self.tokens[rows]

    def batch(self, sample_ids: range, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = self.sequences(sample_ids).to(device)
        return seqs[:, :-1], seqs[:, 1:]


def rank_slice(position: int, global_batch: int, rank: int, world_size: int) -> range:
    """This rank's global sample ids of the batch starting at `position`: a contiguous, near-even split
    (34/33/33 for 100 over 3 ranks), so every id of the global batch goes to exactly one rank."""
    lo = position + global_batch * rank // world_size
    hi = position + global_batch * (rank + 1) // world_size
    return range(lo, hi)
