"""Drafter refresh: online distillation of the draft model toward the current target on fresh rollouts.

As the policy drifts from the model the draft was trained against, acceptance decays. Every `every_n_steps`
optimizer steps the draft takes one pass of gradient steps on the rollouts collected since the last refresh,
minimising the forward KL from the target's next-token distribution to its own at the sampling temperature T,
over the completion positions (the ones it drafts):

    KL(p || q) = sum_v p(v) (log p(v) - log q(v)),  p = softmax(target_logits / T),  q = softmax(draft_logits / T)

The teacher is the policy (the target the generator runs is synced to it before each rollout, so the draft follows
it). A trainable copy of the draft model is trained, then loaded into the generator's drafter atomically
(`RolloutGenerator.load_draft_weights`), on any backend with a draft model. Each process refreshes its own drafter
on its own rollouts (drafts do not change what is sampled, only how fast).
"""

from collections import deque

import torch
import torch.nn.functional as F

from rollout import RolloutBatch, RolloutGenerator
from spec.sampling import GREEDY_TEMPERATURE


class DrafterRefresh:
    """every_n_steps: optimizer steps between refreshes; max_sequences: rollouts kept (the freshest);
    batch_size: sequences per gradient step."""

    def __init__(self, generator: RolloutGenerator, *, every_n_steps: int, learning_rate: float = 1e-4,
                 batch_size: int = 32, max_sequences: int = 512):
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r}: must be an integer >= 1")
        self.generator = generator
        self.draft = generator.draft_model_copy().train()
        self.every_n_steps, self.batch_size = every_n_steps, batch_size
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=learning_rate)
        self.sequences: deque[tuple[list[int], int]] = deque(maxlen=max_sequences)  # (token ids, num prompt tokens)
        self.temperature = 1.0
        self.num_refreshes = 0

    def add(self, batch: RolloutBatch, temperature: float) -> None:
        self.sequences.extend((s.prompt_ids + s.completion_ids, len(s.prompt_ids)) for s in batch.samples)
        self.temperature = temperature if temperature >= GREEDY_TEMPERATURE else 1.0  # greedy: distil at T = 1

    def is_due(self, global_step: int) -> bool:
        return global_step % self.every_n_steps == 0 and len(self.sequences) > 0

    def refresh(self, teacher: torch.nn.Module) -> float:
        """One pass over the collected rollouts toward `teacher` (the policy), then the result is loaded into the
        generator's drafter; returns the mean KL before each step. Clears the collection."""
        sequences = list(self.sequences)
        self.sequences.clear()
        losses = []
        was_training = teacher.training
        teacher.eval()
        try:
            with torch.enable_grad():
                for i in range(0, len(sequences), self.batch_size):
                    losses.append(self._step(teacher, sequences[i:i + self.batch_size]))
        finally:
            teacher.train(was_training)
        self.optimizer.zero_grad(set_to_none=True)
        self.generator.load_draft_weights(self.draft.named_parameters())
        self.num_refreshes += 1
        return sum(losses) / len(losses)

    def _step(self, teacher: torch.nn.Module, sequences: list[tuple[list[int], int]]) -> float:
        loss = self._loss(teacher, sequences)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        return loss.item()

    def _loss(self, teacher: torch.nn.Module, sequences: list[tuple[list[int], int]]) -> torch.Tensor:
        input_ids, attention_mask, loss_mask = _pad(sequences, self.draft.device)
        teacher_device = next(teacher.parameters()).device
        with torch.no_grad():
            target_logits = teacher(input_ids=input_ids.to(teacher_device),
                                    attention_mask=attention_mask.to(teacher_device)).logits
        draft_logits = self.draft(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, L, vocab]
        return distillation_loss(draft_logits, target_logits.to(draft_logits.device), loss_mask, self.temperature)


def distillation_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, loss_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Mean over masked positions of KL(softmax(target / T) || softmax(draft / T)); logits [B, L, vocab]."""
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [B, L]
    return (kl * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def _pad(sequences: list[tuple[list[int], int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask [B, L]; loss mask [B, L] on the positions whose next token is a
    completion token (position t predicts token t + 1)."""
    max_len = max(len(ids) for ids, _ in sequences)
    input_ids = torch.zeros(len(sequences), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), max_len, dtype=torch.long)
    loss_mask = torch.zeros(len(sequences), max_len)
    for i, (ids, num_prompt) in enumerate(sequences):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
        loss_mask[i, num_prompt - 1:len(ids) - 1] = 1
    return input_ids.to(device), attention_mask.to(device), loss_mask.to(device)
