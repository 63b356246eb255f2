"""The local answerer of `make regen`: the target under `transformers.generate`, batches of jobs, left padded.

Right for small corpora, tests and the demo; at scale a serving engine answers instead (`dflash_offline.engine`).
Both write the same records (`dflash_offline.regen`).
"""

from __future__ import annotations

from .regen import Job, hash_seed, split_reasoning


class Regenerator:
    """The target answering batches of jobs: greedy (`temperature` 0) or sampled, left padded, stopping at
    `<|im_end|>` or any eos of the target's generation config. `thinking`: `enable_thinking` of the chat template.
    Sampling draws from a generator seeded by (`seed`, the batch's first input record, the round), so a resumed run
    writes the bytes an uninterrupted one would (for the same batch size)."""

    def __init__(self, model, tok, max_new_tokens: int, thinking: bool, on_truncated: str, on_empty: str,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, settings: dict | None = None):
        from transformers import GenerationConfig

        self.model, self.tok = model, tok
        self.max_new_tokens, self.thinking, self.settings = max_new_tokens, thinking, settings or {}
        self.on_truncated, self.on_empty = on_truncated, on_empty
        self.eos = eos_ids(tok, model)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0 \
            else {"do_sample": False}
        self.seed = seed
        self.gen_cfg = GenerationConfig(**sampling, max_new_tokens=max_new_tokens, eos_token_id=self.eos,
                                        pad_token_id=self.pad, num_beams=1)
        self.max_ctx = context_length(model)

    def process(self, jobs: list[Job]) -> None:
        """Regenerate the batch's turns in order (round k = k-th turn to generate of every job that has one)."""
        for k in range(max((len(j.turns) for j in jobs), default=0)):
            round_jobs = [j for j in jobs if not j.dropped and k < len(j.turns)]
            for job in round_jobs:
                job.next_turn(k)
            if round_jobs:
                self.generate(round_jobs, k)

    def render(self, job: Job) -> str:
        kwargs = {"tools": job.obj["tools"]} if isinstance(job.obj.get("tools"), list) else {}
        return self.tok.apply_chat_template(job.history, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=self.thinking, **self.settings, **kwargs)

    def prompts(self, jobs: list[Job]) -> list[tuple[Job, list[int], str]]:
        """(job, prompt ids, prompt text) of each job whose conversation renders and fits the target's context."""
        ok = []
        for job in jobs:
            try:
                text = self.render(job)
            except Exception as e:  # the chat template rejected the conversation
                job.skip("template_error", f"{type(e).__name__}: {e}")
                continue
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if self.max_ctx and len(ids) + self.max_new_tokens > self.max_ctx:
                job.skip("prompt_too_long", f"{len(ids)} prompt tokens + max_new_tokens {self.max_new_tokens} > the "
                                            f"target's context {self.max_ctx}")
            else:
                ok.append((job, ids, text))
        return ok

    def generate(self, jobs: list[Job], round_: int = 0) -> None:
        """One assistant turn for each job (its `history` ends just before that turn)."""
        import torch

        ok = self.prompts(jobs)
        if not ok:
            return
        width = max(len(ids) for _, ids, _ in ok)
        input_ids = torch.full((len(ok), width), self.pad, dtype=torch.long)
        attn = torch.zeros((len(ok), width), dtype=torch.long)
        for r, (_, ids, _) in enumerate(ok):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            attn[r, width - len(ids):] = 1
        device = next(self.model.parameters()).device
        if self.gen_cfg.do_sample:  # (generate draws from the default generator of the device)
            torch.manual_seed(hash_seed(self.seed, min(job.index for job in jobs), round_))
        with torch.inference_mode():
            gen = self.model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device),
                                      generation_config=self.gen_cfg)
        for (job, ids, text), row in zip(ok, gen[:, width:].tolist(), strict=True):
            stop = next((i for i, t in enumerate(row) if t in self.eos), None)
            new = row[:stop] if stop is not None else row
            msg = assistant_message(self.tok.decode(new, skip_special_tokens=False), prompt_opens_think(text))
            job.add_turn(msg, "stop" if stop is not None else "length", len(new), len(ids), self.on_truncated,
                         self.on_empty)


def assistant_message(text: str, think_open_in_prompt: bool) -> dict:
    content, reasoning = split_reasoning(text, think_open_in_prompt)
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the generation prompt ends inside an open `<think>` block (Qwen3.5 with thinking on)."""
    return prompt_text.rstrip().endswith("<think>")


def pick_dtype(name: str, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(target: str, device, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=pick_dtype(dtype, device))
    return model.to(device).eval()


def eos_ids(tok, model) -> list[int]:
    ids = [tok.convert_tokens_to_ids("<|im_end|>")]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos]:
        if e is not None and e not in ids:
            ids.append(int(e))
    return ids


def context_length(model) -> int:
    conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(conf, "max_position_embeddings", 0) or 0)
