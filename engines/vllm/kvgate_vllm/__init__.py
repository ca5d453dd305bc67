"""kvgate's verifying KV connector for vLLM (`kvgate_vllm.connector.KvgateConnector`).

`digest` and `handoff` hold the arithmetic and the verdicts and import neither vLLM nor torch at
load time, so their tests run in kvgate's CI; `connector`, `metrics` and `faults` run inside vLLM.
"""
