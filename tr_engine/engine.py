"""The Python API: load a model once, then generate. The command-line tools and the benchmarks go through it.

    engine = Engine.from_pretrained("smollm2-135m-instruct")  # dtype "auto" (fp16 on a CPU), method="hybrid"
    result = engine.generate("What is the capital of France?", max_new_tokens=64)
    print(result.text, result.tokens_per_s, result.mean_accepted)
    for piece in engine.stream([{"role": "user", "content": "Tell me a joke."}]):
        print(piece, end="", flush=True)
"""

from contextlib import nullcontext
from pathlib import Path

import torch

from tr_engine import checks
from tr_engine.core.batch import Request, batch_steps, speculative_steps
from tr_engine.core.cost import BUCKETS, CostModel, cost_key
from tr_engine.core.drafting import Drafting, seeder
from tr_engine.core.generation import GenerateResult, batch_results, run_to_end
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.methods import ADAPTIVE, AR, DEFAULT_METHOD, check_method
from tr_engine.core.sampling import GREEDY, Sampler, Sampling, sampling_of
from tr_engine.core.speculative_config import DEFAULT_SUFFIX_MB, SpeculativeConfig
from tr_engine.core.suffix import SuffixIndex
from tr_engine.errors import InvalidType, or_error
from tr_engine.model import cpu
from tr_engine.model.device import check_cuda_graphs
from tr_engine.model.folders import home
from tr_engine.model.llama import Llama
from tr_engine.model.loading import load
from tr_engine.model.runners import Runners
from tr_engine.model.threads import LoadFollower
from tr_engine.model.tokenizer import StreamDecoder, Tokenizer


DEFAULT_MAX_BATCH = 8  # sequences decoded together by generate_batch (--batch)
DEFAULT_BATCH_CONTEXT = 2048  # each batched sequence's cache capacity unless --max-context says otherwise
# A prompt that joins a running batch is prefilled this many tokens at a time, one chunk between two of the batch's
# steps (tr_engine/core/batch.py), so that it holds the others up for one chunk's forward at a time, not its whole
# prefill (--prefill-chunk). bench/results/prefill_stall.md measures it.
DEFAULT_PREFILL_CHUNK = 256


class Engine:
    def __init__(self, model: Llama, tokenizer: Tokenizer, folder: Path, max_context: int, tree: str = ADAPTIVE,
                 matrix_k: int = 8, method: str = DEFAULT_METHOD, seed: int | None = None,
                 cuda_graphs: bool | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 batch_context: int | None = None, suffix_bytes: int = DEFAULT_SUFFIX_MB << 20,
                 max_draft: int | None = None, plain_above: int | None = None, follow_load: bool = False):
        self.model, self.tokenizer, self.folder = model, tokenizer, folder
        # The ops (tr_engine.model.ops), one namespace for the model, the matrix and the decode loop: the model's.
        self.ops = model.ops
        # Sampling's randomness: each sampled call draws its own seed from this stream (or takes the one it is given),
        # so a seeded engine answers a sequence of calls the same way whatever method each uses.
        self.rng = model.shard.generator(seed)  # (under --tp every rank draws alike)
        self.method = check_method(method)  # the default decode method of generate/stream
        self.cuda_graphs = check_cuda_graphs(cuda_graphs, model.device, self.ops)
        self.max_batch = checks.integer(max_batch, "--batch", 1)  # sequences a batch's forward decodes together
        # The caches and what the decode loops run their forwards through (the model, or on a GPU its CUDA graphs):
        # one sequence's, and the batch's (batch_context tokens each).
        self.runners = Runners(model, max_context, self.max_batch, min(batch_context or DEFAULT_BATCH_CONTEXT,
                                                                        max_context))
        self.cache, self.slot = self.runners.cache, self.runners.slot  # (the slot remembers the conversation)
        self.batch_context = self.runners.batch_context
        # With `follow_load` (a CPU engine whose thread count nobody set), the decode loops run the CPU ops on the CPUs
        # other processes leave, up to the process's count (tr_engine/model/threads.py): `pace` is its look between
        # steps.
        self.threads = LoadFollower() if follow_load else None
        self.pace = self.threads.tick if self.threads is not None else None
        # Token Recycling's state (one matrix for the engine's lifetime: hot start across calls), its trees, the cost
        # curve that prices them, and the drafter of each method (tr_engine/core/drafting.py).
        key = cost_key(folder.name, model.dtype, model.device, self.ops.kind, self.cuda_graphs, model.shard.world,
                       self.cpu_tier if "kernels" in self.ops.kind else None)
        self.drafting = Drafting(model, self.cache, key, home(), tree, matrix_k, suffix_bytes, max_draft)
        self.matrix, self.tree, self.tree_spec = self.drafting.matrix, self.drafting.tree, tree
        if self.cuda_graphs:
            self.runners.use_graphs(BUCKETS, self.tree.size)
        self.plain_above = plain_above  # a batch of more sequences decodes plainly (disable_by_batch_size)
        self.prefill_chunk = DEFAULT_PREFILL_CHUNK  # a joining prompt's tokens per step boundary (None: all at once)
        self.on_calibrate = None  # hears the cost curve's measurement: (fraction done, doubt) (cost_model)

    @property
    def cpu_tier(self) -> str | None:
        """The CPU kernel tier this engine's ops run ("avx512bf16", "avx2", ..., "reference"; None off the CPU)."""
        return cpu.tier_of(self.ops, self.model.device)

    @property
    def cpu_threads(self) -> int | None:
        """The threads the CPU ops run on now (following the load unless given: `threads`); None off the CPU."""
        if self.model.device.type != "cpu":
            return None
        return self.threads.threads if self.threads is not None else torch.get_num_threads()

    def drafter(self, method: str):
        """The engine's drafter for `method` (a registered drafter's name), made on first use; the drafters of
        methods that keep a recycling matrix share the engine's."""
        return self.drafting.drafter(method)

    def new_drafter(self, method: str, tree: str | None = None, matrix: RecyclingMatrix | None = None,
                    cost: CostModel | None = None, max_tokens: int | None = None, suffix: SuffixIndex | None = None):
        """A drafter for `method` (tr, pld, hybrid, or any registered since: tr_engine.core.methods) with the engine's
        tree setting or `tree` ("adaptive", "2.2.2", a file), drafting from `matrix` (default: a new, empty one) and,
        for hybrid, from the suffix index `suffix` (tr_engine/core/suffix.py; default: none).
        Pass it to generate/stream as `drafter=` to run several configurations side by side on one model, each with
        its own state (the benchmarks do). An adaptive tree prices its sizes with the engine's measured curve, or
        with `cost` pinned (CostModel.flat, say), and verifies at most `max_tokens` tokens (default: the engine's
        limit, num_speculative_tokens + 1, or the adaptive tree's largest size)."""
        return self.drafting.new_drafter(method, tree, matrix, cost, max_tokens, suffix)

    def cost_model(self, recalibrate: bool = False) -> CostModel:
        """The verify cost curve of this model, dtype, device, kernel tier and thread count (tr_engine/core/cost.py):
        loaded from $TR_ENGINE_HOME/costs/, or measured now (a few seconds; it overwrites the KV cache, so the next
        call prefills its whole prompt) and saved there, unless the measurement was doubtful (a busy machine): then it
        serves this engine only, and the next engine measures again. `on_calibrate(fraction, doubt)`, if set, hears
        the measurement's progress: 0.0 at the start, then fractions, then 1.0 with the doubt (None, or why the curve
        was not saved). It runs on the engine's whole thread count, the one in its key, whatever the load."""
        measuring = recalibrate or self.drafting.cost is None
        with self.threads.at_most() if measuring and self.threads is not None else nullcontext():
            cost, measured = self.drafting.cost_model(self.runners.runner, recalibrate, self.on_calibrate)
        if measured:  # (the measurement ran in the KV cache)
            self.reset_cache()
        return cost

    def use_cost(self, cost: CostModel) -> None:
        """Price this engine's adaptive trees by `cost` from now on, instead of the curve measured on this machine: a
        curve measured elsewhere (CostModel.load), or a synthetic one (CostModel.flat) for an experiment or a test that
        is not about the curve. `cost_model(recalibrate=True)` measures this machine's again."""
        self.drafting.use_cost(cost)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        max_context: int | None = None,
        model_dir: str | None = None,
        ops="kernels",
        threads: int | None = None,
        tree: str = ADAPTIVE,
        matrix_k: int = 8,
        method: str = DEFAULT_METHOD,
        seed: int | None = None,
        cuda_graphs: bool | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        tp: int = 1,
        progress=None,
        suffix_bytes: int = DEFAULT_SUFFIX_MB << 20,
        speculative_config: str | dict | None = None,
        parse_special_tokens: bool = False,
    ) -> "Engine":
        """Load a model (a known name, a Hugging Face-format folder or a GGUF file: tr_engine/model/loading.py) and
        make an engine for it. `method` is what generate and stream use by default; `speculative_config`
        (tr_engine/core/speculative_config.py: JSON text or a dict with vLLM's keys) sets the method, the most draft
        tokens a step verifies and the batch size above which batches decode plainly; `suffix_bytes` bounds hybrid's
        suffix index (default 64 MB, resident only as it fills; 0: none, but method "suffix" then gets 64 MB).
        Special-token strings written in a message's content are text unless `parse_special_tokens`. `threads` fixes
        the CPU ops' thread count; without it a CPU engine (tp 1) starts at torch's and follows the machine's load
        (tr_engine/model/threads.py)."""
        if not isinstance(tree, (str, Path)):
            raise InvalidType(f"tree must be 'adaptive', a tree name or a tree file path, got {type(tree).__name__}")
        check_method(method)
        checks.seed(seed)
        checks.integer(max_batch, "--batch", 1)
        checks.integer(suffix_bytes, "suffix_bytes", 0)
        config = SpeculativeConfig.parse(speculative_config or {}, "speculative_config")
        if config.suffix and not suffix_bytes:
            suffix_bytes = DEFAULT_SUFFIX_MB << 20
        m = load(name_or_path, device, dtype, max_context, model_dir, ops, threads, cuda_graphs, tp, progress,
                 parse_special_tokens)  # (tr_engine/model/loading.py)
        return cls(m.model, m.tokenizer, m.folder, m.max_context, str(tree), matrix_k, config.method or method, seed,
                   m.cuda_graphs, max_batch, max_context, suffix_bytes, config.num_speculative_tokens,
                   config.disable_by_batch_size, threads is None and m.model.device.type == "cpu" and tp == 1)

    def prompt_ids(self, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
        """Token ids for a prompt: a string (wrapped as one user message unless chat_template=False) or messages
        ([{'role': str, 'content': str}, …]). Anything else is refused with an InvalidType or InvalidValue."""
        return self.tokenizer.prompt_ids(prompt, chat_template)

    def save_matrix(self, path) -> None:
        """Save the recycling matrix atomically, and the suffix index (if any) beside it; a MatrixFileError or an
        IndexFileError (the old file kept) when it cannot be written."""
        self.drafting.save_matrix(path, self.tokenizer.fingerprint())

    def load_matrix(self, path) -> None:
        """Load a saved recycling matrix (checked: MatrixFileError when it is not one for this model and k), and the
        suffix index saved beside it, if this engine keeps one (IndexFileError when that file is not one)."""
        self.drafting.load_matrix(path, self.tokenizer.fingerprint())

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 256, chat_template: bool = True,
                 method: str | None = None, seed_from_prompt: bool = False, reuse_cache: bool = False,
                 drafter=None, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, ignore_eos: bool = False, cancel=None,
                 sampling: Sampling | None = None) -> GenerateResult:
        """Answer a prompt (a string, or a conversation as messages): `method` "ar" (plain decoding), "tr" (Token
        Recycling), "pld" (prompt lookup) or "hybrid" (both in one tree), default the engine's; all emit the same
        tokens, greedy (temperature 0, the default) or sampled from the model's distribution (temperature, top_k,
        top_p, or `sampling`, a Sampling built once where the request came in; `seed` fixes this call's draws, else
        they come from the engine's seeded stream). `drafter` (from new_drafter) overrides `method`. The recycling
        matrix persists across calls. With `reuse_cache`, the part of the prompt the cache already holds (the earlier
        turns of a conversation, with their answers) is not computed again; otherwise every call starts from an empty
        cache. With `ignore_eos`, decoding goes on past the end-of-sequence token to max_new_tokens (a benchmark's
        fixed length). `cancel`, a threading.Event set from any thread, ends the call at the next step boundary: its
        result holds what was generated, finish_reason "cancelled"."""
        return run_to_end(self.stream(prompt, max_new_tokens, chat_template, method, seed_from_prompt, reuse_cache,
                                      drafter, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                      ignore_eos=ignore_eos, cancel=cancel, sampling=sampling))

    def stream(self, prompt: str | list[dict], max_new_tokens: int = 256, chat_template: bool = True,
               method: str | None = None, seed_from_prompt: bool = False, reuse_cache: bool = False, drafter=None,
               *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               ignore_eos: bool = False, cancel=None, sampling: Sampling | None = None):
        """Like generate, yielding the answer's text as it is accepted (whole characters only); returns the
        GenerateResult (`result = yield from engine.stream(…)`, or StopIteration.value)."""
        sampling = sampling_of(sampling, temperature, top_k, top_p)
        checks.generation(max_new_tokens, seed, cancel, seed_from_prompt=seed_from_prompt, reuse_cache=reuse_cache,
                          ignore_eos=ignore_eos)
        ids = self.prompt_ids(prompt, chat_template)
        gen = yield from StreamDecoder(self.tokenizer, ids).texts(self.decode_steps(
            ids, max_new_tokens, method, seed_from_prompt, reuse_cache, drafter, sampling, seed, ignore_eos, cancel))
        return GenerateResult.of(gen, ids, self.tokenizer)

    def generate_batch(self, prompts: list, max_new_tokens: int = 256, chat_template: bool = True,
                       method: str | None = None, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seed: int | None = None, batch_size: int | None = None,
                       seed_from_prompt: bool = False, ignore_eos: bool = False,
                       sampling: Sampling | None = None) -> list[GenerateResult]:
        """Answer many prompts at once, up to the engine's max_batch in each forward (more are queued and join as
        others finish): one GenerateResult per prompt, in order, each with exactly the tokens generate() gives that
        prompt alone (sampled: with `seed` + its index as its seed). A prompt that cannot run (empty, too long for
        the batch's per-sequence cache) gets a result with `error` set and no tokens; the others finish.
        `batch_size` (at most max_batch, the default) caps the sequences in a forward. `seed_from_prompt`: each
        prompt's prefill seeds the shared matrix, as in generate(); `ignore_eos` as in generate()."""
        return run_to_end(self.stream_batch(prompts, max_new_tokens, chat_template, method, temperature=temperature,
                                            top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size,
                                            seed_from_prompt=seed_from_prompt, ignore_eos=ignore_eos,
                                            sampling=sampling))

    def stream_batch(self, prompts: list, max_new_tokens: int = 256, chat_template: bool = True,
                     method: str | None = None, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     seed: int | None = None, batch_size: int | None = None, seed_from_prompt: bool = False,
                     ignore_eos: bool = False, sampling: Sampling | None = None):
        """Like generate_batch, yielding (prompt index, text piece) as each request's tokens are accepted; returns
        the results (`results = yield from engine.stream_batch(…)`)."""
        sampling = sampling_of(sampling, temperature, top_k, top_p)
        checks.generation(max_new_tokens, seed, seed_from_prompt=seed_from_prompt, ignore_eos=ignore_eos)
        if batch_size is not None:
            checks.integer(batch_size, "batch_size", 1, self.max_batch)
        method = check_method(method or self.method)
        if not isinstance(prompts, (list, tuple)):
            raise InvalidType(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        ids = [or_error(self.prompt_ids, prompt, chat_template) for prompt in prompts]  # (or why it cannot run)
        requests = [Request(i, p, max_new_tokens, self.sampler(sampling, checks.nth_seed(seed, i)),
                            ignore_eos=ignore_eos) for i, p in enumerate(ids) if isinstance(p, list)]
        return (yield from batch_results(self.tokenizer, ids, self.batch_loop(requests, method, seed_from_prompt,
                                                                              batch_size)))

    def batch_loop(self, requests, method: str | None = None, seed_from_prompt: bool = False,
                   limit: int | None = None, reuse_prefix: bool = False):
        """The batch driver (tr_engine/core/batch.py's batch_steps) over `requests` (Requests, or a scheduler's source
        of them), in the engine's batch cache, drafting with `method`'s drafter (priced by this machine's curve):
        generate_batch and the server both decode through it."""
        drafter = self.priced(method)
        cache = self.batch_cache()  # (then the batch's runner is set)
        return batch_steps(self.runners.batch_runner, cache, requests, drafter, self.tokenizer.eos_ids, self.ops,
                           limit, reuse_prefix, seeder(drafter, seed_from_prompt), self.plain_above, self.pace,
                           self.prefill_chunk)

    def priced(self, method: str | None, drafter=None):
        """The drafter a decode loop runs for `method` (default the engine's; `drafter` given: that one), its adaptive
        tree priced by this machine's curve (measured at first use) unless pinned; None for plain decoding."""
        method = drafter.name if drafter is not None else check_method(method or self.method)
        if method == AR:  # (ar: no drafter, each step the root alone, through the same loop)
            return None
        return self.drafting.priced(drafter or self.drafter(method), self.cost_model)

    def batch_cache(self):
        """The batch's slots (max_batch of batch_context tokens), allocated at the first batch."""
        return self.runners.batch_cache()

    def decode_steps(self, ids: list[int], max_new_tokens: int, method: str | None = None,
                     seed_from_prompt: bool = False, reuse_cache: bool = False, drafter=None,
                     sampling: Sampling = GREEDY, seed: int | None = None, ignore_eos: bool = False, cancel=None):
        """The decode loop for prompt token ids: yields each step's committed ids, returns the Generation."""
        sampler = self.sampler(sampling, seed)
        check_method(method or self.method)  # (an unknown method is named before a prompt too long)
        # Refuse what cannot fit before measuring anything (the decode loops check the same again); then the drafter,
        # whose curve, measured once, overwrites the cache: before anything is cached.
        self.cache.check_room(len(ids) + max_new_tokens, "the prompt plus --max-new-tokens", start=0)
        drafter = self.priced(method, drafter)
        return (yield from speculative_steps(self.runners.runner, self.slot, ids, drafter, max_new_tokens,
                                             self.tokenizer.eos_ids, self.ops, seeder(drafter, seed_from_prompt),
                                             sampler, ignore_eos, cancel, reuse_prefix=reuse_cache,
                                             pace=self.pace))

    def sampler(self, sampling: Sampling, seed: int | None = None) -> Sampler | None:
        """The draws of one sampled call (None when greedy): from `seed`, else from a seed taken off the engine's
        stream, one per call whatever the method, so seeded runs repeat exactly."""
        return Sampler.of(sampling, seed, self.rng)

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose K/V the cache holds (the conversation so far, but its last token), reused by the next
        call with reuse_cache where its prompt starts with them."""
        return self.slot.held[0]

    def reset_cache(self) -> None:
        """Forget the cached conversation (the next call prefills its whole prompt)."""
        self.slot.forget()
