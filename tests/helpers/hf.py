"""What the tests that train under Hugging Face's Trainer (or TRL's SFTTrainer) share: token data
as a Dataset, the arguments every such run sets (CPU, no reports, seeded, 2 sequences per device
and 2 accumulation steps, a log line per step), and what a run is compared by."""

import torch


class Tokens(torch.utils.data.Dataset):
    """`n` sequences of `seq` token ids below 128 (labels = inputs), seeded."""

    def __init__(self, n=16, seq=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(out, **kw) -> dict:
    """The keyword arguments of TrainingArguments (or SFTConfig) for a run writing to `out`:
    the common ones, then `kw`."""
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **kw,
    )


def losses_and_norms(trainer):
    """(loss, grad_norm) of every logged step."""
    return [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]


def final_weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
