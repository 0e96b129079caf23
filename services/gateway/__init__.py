"""The gateway service: OpenAI-compatible HTTP in front of the scheduler (see app.py).

Modules: app (create_app), main (run_gateway / CLI), engine_client (NATS link to the
scheduler), schemas (request bodies), sampling (SamplingParams and model-dependent checks),
completions / chat / tokenization (routes), generation + choice (running choices), detokenizer,
stop_strings, logprobs, serving + sse (responses), middleware, metrics, errors, context.
"""
