"""Structured outputs: a request's output held to a grammar (a JSON schema, any JSON object, a
regular expression, a list of choices, a Lark / GBNF grammar) by a token mask applied on the device.

  params.py    `StructuredOutputsParams`, vLLM's shape, checked and turned into one grammar text
  grammars.py  `GrammarCompiler`: the model's tokenizer for the grammar library, grammars compiled
               off the engine thread and cached by their text; `RequestGrammar`, a request's matcher
  bitmask.py   the device side: each row's allowed-token bitmask, written per step, applied in the
               compiled sampler as a runtime input (one program for masked and unmasked rows)

The grammar library is llguidance (chosen by measurement, benchmarks/structured.py; it has no
dependencies, fills many rows' masks in parallel off the GIL, rolls back and validates drafts)."""
