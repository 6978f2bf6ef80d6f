"""qbench as an lm-eval model: ``lm_eval --model qbench --model_args pretrained=ARTIFACT ...``.

Every request runs on qbench's engine through a ``Subject``, so the KV-cache scheme of the artifact
(or ``kv=RECIPE``) is what lm-eval scores. Tokenization and windowing follow lm-eval's HFLM:
- loglikelihood: context and continuation encoded together and split (TemplateLM._encode_pair), the
  input left-truncated to max_length + 1 tokens, the continuation's log-probs summed;
- loglikelihood_rolling: lm-eval's disjoint rolling windows with the prefix token, context_len 1;
- generate_until: greedy unless do_sample, the context left-truncated to max_length - max_gen_toks,
  the text cut at the first stop string (the EOS string is always one).

lm-eval finds "qbench" through qbench/lm_eval_hook.py (installed as a .pth), which registers this
class lazily; importing this module registers it too.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from qbench.engine.sampling import SamplingParams
from qbench.errors import QBenchError
from qbench.evals.subject import Subject

GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "seed"}


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise QBenchError(f"--model_args {name}={value!r}: expected an integer") from None


@register_model("qbench")
class QBenchLM(TemplateLM):
    def __init__(self, pretrained: str, batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, kv: str | None = None, seed: int = 0, device: str | None = None,
                 max_batch_size: int | None = None, **unused):
        super().__init__()
        # lm-eval always passes its --device (default "cuda:0"); qbench's engine runs on the CPU.
        if unused:
            raise QBenchError(f"--model_args: unknown argument(s) {', '.join(sorted(unused))}; qbench takes "
                              f"pretrained, batch_size, max_length, max_gen_toks, kv and seed")
        if batch_size is None or str(batch_size).startswith("auto"):
            batch_size = max_batch_size or 8  # the engine sizes its own pool; no probing needed on the CPU
        scheme = None
        if kv:
            from qbench.quant.recipe import load_kv_scheme
            scheme = load_kv_scheme(kv)
        self.subject = Subject(str(pretrained), _int(batch_size, "batch_size"), kv_scheme=scheme)
        self.tokenizer = self.subject.tokenizer
        window = self.subject.engine.config.max_positions
        self._max_length = _int(max_length, "max_length") if max_length else window
        if self._max_length > window:
            raise QBenchError(f"--model_args max_length={self._max_length}: the model's window is {window}")
        self.max_gen_toks = _int(max_gen_toks, "max_gen_toks")
        self.seed = _int(seed, "seed")

    # -- lm-eval's tokenization hooks ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            return self.subject.encode(string)
        return self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- chat templates (--apply_chat_template, --fewshot_as_multiturn), rendered as lm-eval's HFLM does ----
    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "qbench").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # -- scoring ------------------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable_tqdm: bool):
        """(context, continuation) token pairs -> (sum log-prob, greedy?) each, batched longest first."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        bs = self.subject.batch_size
        bar = tqdm(total=len(pairs), desc=desc, disable=disable_tqdm)
        for s in range(0, len(order), bs):
            idx = order[s: s + bs]
            windows, spans = [], []
            for i in idx:
                ctx, cont = pairs[i]
                if not cont:
                    raise QBenchError("lm-eval sent a request with an empty continuation")
                full = (ctx + cont)[-(self.max_length + 1):]
                windows.append(full[:-1])  # the last token is only ever a target
                spans.append(cont[-len(full) + 1:] if len(cont) >= len(full) else cont)
            for i, lp, cont in zip(idx, self.subject.logprobs(windows), spans):
                tail = lp[lp.shape[0] - len(cont):]  # (n, V): position t predicts token t + 1
                target = torch.tensor(cont)
                logp = tail.gather(1, target[:, None]).sum().item()
                out[i] = (float(logp), bool((tail.argmax(-1) == target).all()))
            bar.update(len(idx))
        bar.close()
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self._score([(ctx, cont) for _, ctx, cont in requests], "qbench loglikelihood", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for w in map(make_disjoint_window, rolling):
                windows.append(w)
                owner.append(r)
        scores = self._score(windows, "qbench loglikelihood_rolling", disable_tqdm)
        total = [0.0] * len(requests)
        for r, (logp, _) in zip(owner, scores):
            total[r] += logp
        return total

    # -- generation ---------------------------------------------------------------------------------
    def _params(self, gen_kwargs: dict) -> tuple[SamplingParams, int]:
        kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        unknown = set(kw) - GEN_KEYS
        if unknown:
            raise QBenchError(f"generation_kwargs: qbench does not support {', '.join(sorted(unknown))}; "
                              f"it takes {', '.join(sorted(GEN_KEYS))}")
        until = handle_stop_sequences(kw.get("until"), eos=self.tokenizer.decode([self.eot_token_id]))
        greedy = not kw.get("do_sample") or not kw.get("temperature")
        params = SamplingParams(temperature=0.0 if greedy else float(kw["temperature"]),
                                top_p=float(kw.get("top_p") or 1.0), top_k=int(kw.get("top_k") or 0),
                                max_new_tokens=int(kw["max_gen_toks"]), stop=tuple(until),
                                seed=int(kw.get("seed", self.seed)))
        return params, int(kw["max_gen_toks"])

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            params, max_gen = self._params(dict(gen_kwargs))
            room = self.max_length - max_gen
            if room <= 0:
                raise QBenchError(f"max_gen_toks={max_gen} leaves no room for a prompt in max_length={self.max_length}")
            jobs.append((self.tok_encode(context)[-room:], params))
        out: list[str] = [""] * len(jobs)
        bs = self.subject.batch_size
        bar = tqdm(total=len(jobs), desc="qbench generate_until", disable=disable_tqdm)
        for s in range(0, len(jobs), bs):
            group = list(range(s, min(s + bs, len(jobs))))
            seqs = self.subject.generate([jobs[i][0] for i in group], [jobs[i][1] for i in group])
            for i, seq in zip(group, seqs):
                text = seq.text
                for stop in jobs[i][1].stop:  # the engine already stopped there; EOS text is cut here too
                    text = text.split(stop)[0]
                out[i] = text
            bar.update(len(group))
        bar.close()
        return out
