"""Prefill ranks (PD mode): run prompts, hand their KV pages to a decode rank.

Arrives with the prefill/decode issue. A prefill rank speaks the same router link as every
rank (pd_server/protocol/: Hello with role "prefill", Generate carrying decode_rank), runs
the engine with add_request(prefill_only=True), and sends the KVExport's page descriptors
to the decode rank over the prefill<->decode link (pd_server/protocol/prefill_decode.py).
Until then, colocated ranks (decode/rank.py --role colocated) serve every request.
"""
