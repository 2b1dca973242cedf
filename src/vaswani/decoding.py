"""Greedy and beam search as transformers runs them, with less work per decoding step.

    model.generate(**batch, num_beams=4, custom_generate=vaswani.decoding.decode)   # one call
    vaswani.decoding.use_lean_decoding(model)                                        # every later generate() call

`decode` plugs into `generate()` through its own extension point (`custom_generate`, a decoding method): generate()
still validates the arguments, runs the encoder, expands the batch for the beams, makes the cache and builds the
logits processors and stopping criteria; `decode` replaces only the loop over decoding steps. The outputs are
transformers' own: the same tokens for greedy search, and the same hypotheses for beam search, whose bookkeeping
(finished hypotheses, length penalty, early stopping) is transformers' helper methods, called as they are
(tests/test_decoding.py compares both with generate() without it; on the main job's model, 1,000 of 1,000 test
translations are identical in fp32). One caveat: items 4 and 5 change the shapes of the matrix products, which may
change the last bit of a result, and int8's per-tensor activation scales depend on which rows share a tensor: in
int8, 980 of 1,000 were identical, BLEU 29.47 against 29.58 (benchmarks/results/decoding-loops-cpu.md).
What changes is the work around the model, which on a CPU is a large share of each step once the matrix
multiplications are int8 (benchmarks/README.md):

1. Each step calls the model with the source encoding and the cache directly, without generate()'s per-step
   re-preparation of its keyword arguments.
2. Greedy search takes the argmax of the raw logits (transformers first copies them to a new float32 tensor)
   with `_top_k`, a two-level search over blocks of the vocabulary that returns the same token as `torch.argmax`.
3. Beam search ranks tokens within each beam before it ranks beams. The best 2·beams continuations of a sentence
   are among the best 2·beams tokens of each of its beams, so `_top_k` picks those from each beam's
   log-probabilities, and only beams × 2·beams candidates get the beam's running score added and compete;
   transformers adds the running score to every beam × vocabulary entry and ranks all of them (4 × 32,000 per
   sentence here).
4. Beam search keeps one copy of each source encoding, not one per beam (generate() repeats it): the model's
   cross-attention then attends with all of a sentence's beams at once (`VaswaniAttention`), and the
   cross-attention keys/values are projected and cached once per sentence instead of once per beam.
5. Finished sentences leave the batch. transformers decodes every row until the whole batch stops; here a greedy
   row leaves once it has stopped (it gets padding from then on, as in transformers), and a beam-search sentence
   leaves once transformers' own early-stopping test says no later step can change its finished hypotheses (that
   test never turns back). On the main job's test set that is 44% of beam search's sentence-steps. Not done when
   logits processors are given: some of them (`prefix_allowed_tokens_fn`) address rows by their batch index.

Anything else (sampling, `return_dict_in_generate`, a decoder-only or non-Vaswani model, a pre-filled or static
cache) goes to transformers' own decoding method unchanged. The scripts decode this way on CPUs (`--device cpu`,
the default without a GPU); on GPUs it is measured by the benchmark's `vaswani-lean` engine before it becomes the
scripts' default there.
"""

import functools

import torch
from transformers.cache_utils import DynamicLayer, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.generation.utils import GENERATION_MODES_MAPPING
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutput


def _block_size(vocab_size: int, k: int) -> int | None:
    """The largest power-of-two block (8 … 128 entries) that tiles the vocabulary into at least k blocks."""
    for block in (128, 64, 32, 16, 8):
        if vocab_size % block == 0 and vocab_size // block >= k:
            return block
    return None


def _top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k, dim=-1)` over rows of vocabulary size, in two levels: the k best entries of a row lie in the
    k blocks with the highest maxima (a block holding one of them has a maximum at least as high as the k-th best,
    and at most k blocks do), so only those k blocks are searched. On this project's 2-core CPU it is 3.4× faster
    than `topk(8)` over 128 rows × 32,000, and 6× faster than `argmax` over 32 rows, which it matches exactly for
    k = 1 (the first maximal block, then the first maximum in it). For k > 1, equal scores may be ordered
    differently."""
    rows, vocab_size = scores.shape
    block = _block_size(vocab_size, k)
    if block is None:
        return scores.topk(k, dim=-1)
    blocks = scores.view(rows, vocab_size // block, block)  # (rows, blocks, block)
    if k == 1:
        best_block = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # (rows, 1)
    else:
        best_block = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (rows, k)
    candidates = blocks.gather(1, best_block[..., None].expand(-1, -1, block)).flatten(1)  # (rows, k·block)
    values, position = candidates.topk(k, dim=-1) if k > 1 else candidates.max(dim=-1, keepdim=True)
    return values, best_block.gather(1, position // block) * block + position % block


def _lean_mode(model, generation_config, model_kwargs) -> GenerationMode | None:
    """The mode when `decode` covers this call (greedy or beam search); None sends it to transformers' own method."""
    mode = generation_config.get_generation_mode()
    cache = model_kwargs.get("past_key_values")
    covered = (
        mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)
        and model.config.model_type == "vaswani"  # its cross-attention takes one source row per sentence
        and model.config.is_encoder_decoder
        and not generation_config.return_dict_in_generate
        and model_kwargs.get("encoder_outputs") is not None
        and model_kwargs.get("decoder_attention_mask") is None
        and model_kwargs.get("use_cache", True)
        and isinstance(cache, EncoderDecoderCache)
        and cache.get_seq_length() == 0
        and all(type(layer) is DynamicLayer for layer in cache.self_attention_cache.layers)
    )
    return mode if covered else None


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """A `custom_generate` decoding method for `generate()`: greedy or beam search (see the module docstring)."""
    mode = _lean_mode(model, generation_config, model_kwargs)
    if mode is None:
        # transformers' own method for this mode, from its own table; of those, only its sampling and beam-search
        # loops run on what generate() hands a decoding method (assisted decoding needs its assistant, the rest are
        # Hub repositories).
        name = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
        if name not in ("_sample", "_beam_search"):
            raise ValueError(f"vaswani.decoding.decode runs greedy search, sampling and beam search, not "
                             f"{generation_config.get_generation_mode().value}; call generate() without it.")
        method = getattr(GenerationMixin, name)
        return method(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
    cache = model_kwargs["past_key_values"]
    encoder_outputs, attention_mask = model_kwargs["encoder_outputs"], model_kwargs.get("attention_mask")
    if mode == GenerationMode.BEAM_SEARCH:  # one source row per sentence (item 4 of the module docstring)
        beams = generation_config.num_beams
        encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state[::beams])
        attention_mask = attention_mask[::beams] if attention_mask is not None else None
    state = (encoder_outputs, attention_mask, cache)
    if mode == GenerationMode.GREEDY_SEARCH:
        return _greedy(model, input_ids, state, logits_processor, stopping_criteria, generation_config)
    return _beam(model, input_ids, state, logits_processor, stopping_criteria, generation_config)


def _next_token_logits(model, decoder_input_ids, encoder_outputs, attention_mask, past_key_values) -> torch.Tensor:
    """One decoding step: the logits of the next token after `decoder_input_ids` (B, new) given the cache."""
    outputs = model(
        decoder_input_ids=decoder_input_ids,
        encoder_outputs=encoder_outputs,
        attention_mask=attention_mask,
        past_key_values=past_key_values,
        use_cache=True,
        logits_to_keep=1,
    )
    return outputs.logits[:, -1]  # (B, vocab)


def _greedy(model, input_ids, state, logits_processor, stopping_criteria, generation_config) -> torch.Tensor:
    """transformers' `_sample` without sampling: the argmax token, padding after a sequence has stopped; stopped
    sequences leave the batch (item 5 of the module docstring)."""
    pad_token_id = generation_config._pad_token_tensor
    stops_at_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    live = torch.arange(input_ids.shape[0], device=input_ids.device)  # the rows still decoded
    new_tokens = input_ids  # the first step reads the whole decoder prompt, later steps the last token
    while True:
        logits = _next_token_logits(model, new_tokens, *state)
        if logits_processor:
            next_tokens = logits_processor(input_ids, logits.float()).argmax(dim=-1)
        else:
            next_tokens = _top_k(logits, 1)[1].squeeze(1)
        if stops_at_eos:  # stopped rows get padding (those that left the batch, and those that just stopped)
            tokens = pad_token_id.expand(input_ids.shape[0]).clone()
            tokens[live] = next_tokens * unfinished[live] + pad_token_id * (1 - unfinished[live])
            next_tokens = tokens
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, None)
        if unfinished.max() == 0:
            return input_ids
        if stops_at_eos and not logits_processor:
            stopped = unfinished[live] == 0
            if stopped.any():
                keep = (~stopped).nonzero().squeeze(1)
                live = live[keep]
                state = _keep_rows(state, keep, keep)
        new_tokens = input_ids[live, -1:]


def _beam(model, input_ids, state, logits_processor, stopping_criteria, generation_config) -> torch.Tensor:
    """transformers' `_beam_search` (deterministic, sequences only), with the candidate ranking of the module
    docstring; its helper methods keep the hypotheses. Sentences whose hypotheses can no longer change leave the
    batch (item 5). Shapes: sentences B, beams N, candidates C = 2N or more."""
    eos_token_id = generation_config._eos_token_tensor
    pad_token_id = generation_config._pad_token_tensor
    early_stopping, length_penalty = generation_config.early_stopping, generation_config.length_penalty
    max_length, num_beams = generation_config.max_length, generation_config.num_beams
    num_return_sequences = generation_config.num_return_sequences
    rows, cur_len = input_ids.shape
    batch_size = rows // num_beams
    prompt_len = cur_len
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams
    device = input_ids.device
    top_num_beam_mask = torch.arange(beams_to_keep, device=device) < num_beams

    fill = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1  # transformers' filler, as written there
    running_sequences = torch.full((batch_size, num_beams, max_length), fill, dtype=torch.long, device=device)
    running_sequences[:, :, :cur_len] = input_ids.view(batch_size, num_beams, cur_len)
    sequences = running_sequences.clone()  # the finished hypotheses
    running_scores = torch.zeros((batch_size, num_beams), device=device)
    running_scores[:, 1:] = -1e9  # the beams start identical: only the first may expand at the first step
    beam_scores = torch.full((batch_size, num_beams), -1e9, device=device)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    improvable = torch.ones((batch_size, 1), dtype=torch.bool, device=device)
    running_beam_indices = torch.full((batch_size, num_beams, max_length - cur_len), -1, dtype=torch.int32,
                                      device=device)
    beam_indices = running_beam_indices.clone()
    # The results of sentences that left the batch, and the original index of each sentence still in it.
    final_sequences, final_beam_indices = sequences.clone(), beam_indices.clone()
    live = torch.arange(batch_size, device=device)

    new_tokens = input_ids
    while True:
        flat_running = running_sequences[:, :, :cur_len].reshape(rows, cur_len)
        log_probs = torch.log_softmax(_next_token_logits(model, new_tokens, *state).float(), dim=-1)  # (B·N, vocab)
        if logits_processor:
            log_probs = logits_processor(flat_running, log_probs)
        # The best C tokens of every beam, then the best C (beam, token) pairs of every sentence.
        token_scores, tokens = _top_k(log_probs, beams_to_keep)  # (B·N, C)
        scores = (token_scores + running_scores.view(rows, 1)).view(batch_size, num_beams * beams_to_keep)
        topk_log_probs, choice = scores.topk(beams_to_keep, dim=-1)  # (B, C)
        topk_beams = choice // beams_to_keep
        topk_tokens = tokens.view(batch_size, -1).gather(1, choice)

        # What transformers' `_get_top_k_continuations` makes of its top-k over beams × vocabulary.
        topk_running_sequences = model._gather_beams(running_sequences, topk_beams)
        topk_running_sequences[:, :, cur_len] = topk_tokens
        topk_running_beam_indices = model._gather_beams(running_beam_indices, topk_beams)
        batch_offset = torch.arange(batch_size, device=device).view(-1, 1) * num_beams
        topk_running_beam_indices[:, :, cur_len - prompt_len] = topk_beams + batch_offset

        hits_stop = stopping_criteria(topk_running_sequences[:, :, : cur_len + 1].flatten(0, 1), None)
        hits_stop = hits_stop.view(batch_size, beams_to_keep)
        running_sequences, running_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs,
            topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices,
            next_token_hits_stopping_criteria=hits_stop,
            num_beams=num_beams,
        )
        sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
            sequences=sequences,
            topk_running_sequences=topk_running_sequences,
            beam_scores=beam_scores,
            topk_log_probs=topk_log_probs,
            beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=improvable,
            is_sent_finished=is_sent_finished,
            next_token_hits_stopping_criteria=hits_stop,
            top_num_beam_mask=top_num_beam_mask,
            num_beams=num_beams,
            cur_len=cur_len,
            decoder_prompt_len=prompt_len,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        model._reorder_cache(state[2], running_beam_indices[..., cur_len - prompt_len].flatten())
        cur_len += 1
        improvable = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=improvable,
            running_beam_scores=running_scores,
            beam_scores=beam_scores,
            is_sent_finished=is_sent_finished,
            cur_len=cur_len,
            max_length=max_length,
            decoder_prompt_len=prompt_len,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
        )
        if not model._beam_search_has_unfinished_sequences(improvable, is_sent_finished, hits_stop, early_stopping):
            break
        done = ~improvable[:, 0]  # no later step can change these sentences' finished hypotheses
        if done.any() and not logits_processor:
            final_sequences[live[done]], final_beam_indices[live[done]] = sequences[done], beam_indices[done]
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep[:, None] * num_beams + torch.arange(num_beams, device=device)).flatten()
            live = live[keep]
            per_sentence = (running_sequences, running_scores, running_beam_indices, sequences, beam_scores,
                            beam_indices, is_sent_finished, improvable)
            (running_sequences, running_scores, running_beam_indices, sequences, beam_scores, beam_indices,
             is_sent_finished, improvable) = (tensor[keep] for tensor in per_sentence)
            state = _keep_rows(state, keep, keep_rows)
            batch_size, rows = len(keep), len(keep_rows)
        new_tokens = running_sequences[:, :, cur_len - 1].reshape(rows, 1)
    final_sequences[live], final_beam_indices[live] = sequences, beam_indices

    # The best hypotheses of each sentence, cut to the longest one returned.
    sequences = final_sequences[:, :num_return_sequences].flatten(0, 1)
    beam_indices = final_beam_indices[:, :num_return_sequences].flatten(0, 1)
    generated = (beam_indices + 1).bool().sum(dim=1).max()
    return sequences[:, : prompt_len + generated]


def _keep_rows(state, sources, rows):
    """The decoding state of the sentences that stay in the batch: their source rows (`sources`) of the encoder
    output, its mask and the cross-attention cache, and their decoder rows (`rows`) of the self-attention cache."""
    encoder_outputs, attention_mask, cache = state
    for layer in cache.self_attention_cache.layers:
        layer.batch_select_indices(rows)
    for layer in cache.cross_attention_cache.layers:
        layer.batch_select_indices(sources)
    encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state[sources])
    return encoder_outputs, attention_mask[sources] if attention_mask is not None else None, cache


def use_lean_decoding(model):
    """Make every later `model.generate()` call use `decode` (a call may still pass its own `custom_generate`);
    return `model`. Per instance, like transformers' own Hub `custom_generate` loading."""
    model.generate = functools.partial(type(model).generate, model, custom_generate=decode)
    return model
