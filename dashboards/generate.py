#!/usr/bin/env python3
"""Writes kvgate's Grafana dashboards (dashboards/*.json) from the panel lists below.

Run `make generate` after editing (it runs this and copies the result into the chart); `--check`
fails when a file is stale (a test runs it). Conventions (checked by operator/tests/observability.rs): one datasource variable
`datasource`, `namespace` and `deployment` variables from label values, stable uids, a unit and a
description on every panel, `$__rate_interval` in rates.
"""
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).parent
DS = {"type": "prometheus", "uid": "${datasource}"}
W = 'namespace=~"$namespace", deployment=~"$deployment"'   # worker series
OP = 'namespace=~"$namespace", name=~"$deployment"'        # operator series of one deployment
TOKENS = "suffix: tokens"


def quantiles(metric, sel, by=""):
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [
        (f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[$__rate_interval])))", f"{legend}p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def panel(title, description, unit, targets, kind="timeseries", thresholds=None, w=12, h=8):
    defaults = {"unit": unit}
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
        defaults["color"] = {"mode": "thresholds"}
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
        "_size": (w, h),
    }
    if kind == "stat":
        p["options"] = {"colorMode": "background", "graphMode": "none", "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    if kind == "table":
        for t in p["targets"]:
            t["instant"] = True
            t["format"] = "table"
    return p


# A Jaeger search for decode's refused handoffs in the panel's time range (Jaeger wants
# microseconds; Grafana's ${__from} is milliseconds), by span attributes (a span's error status
# is not one a search can match): `refused` on any refusal, `error.type` naming the reason.
JAEGER_SEARCH = ("${jaeger}/search?service=kvgate-decode&operation=handoff_receive&limit=20"
                 "&start=${__from}000&end=${__to}000&tags={tags}")


def jaeger_link(p, by_reason):
    """Adds the data link to the failing spans' traces (README: finding the request behind a mismatch)."""
    tags = "%7B%22error.type%22%3A%22${__field.labels.reason}%22%7D" if by_reason else "%7B%22refused%22%3A%22true%22%7D"
    title = "Traces of these refusals in Jaeger" if by_reason else "Traces of refused handoffs in Jaeger"
    p["fieldConfig"]["defaults"]["links"] = [{"title": title, "url": JAEGER_SEARCH.replace("{tags}", tags), "targetBlank": True}]
    return p


def jaeger_slow(p):
    """Adds a data link to the traces of requests at least as slow as the clicked value (seconds)."""
    url = ("${jaeger}/search?service=kvgate-router&operation=POST%20%2Fv1%2Fcompletions&limit=20"
           "&start=${__from}000&end=${__to}000&minDuration=${__value.raw}s")
    p["fieldConfig"]["defaults"]["links"] = [{"title": "Requests this slow in Jaeger", "url": url, "targetBlank": True}]
    return p


def variable(name, label, query):
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-query"}, "definition": query,
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
    }


def dashboard(uid, title, description, panels):
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        w, h = p.pop("_size")
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        p["id"] = i
        p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        x, row_h = x + w, max(row_h, h)
    return {
        "uid": uid, "title": title, "description": description, "tags": ["kvgate"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "current": {}, "hide": 0},
            variable("namespace", "Namespace", "label_values(kvgate_build_info, namespace)"),
            variable("deployment", "Deployment", 'label_values(kvgate_requests_total{namespace=~"$namespace"}, deployment)'),
            {"name": "jaeger", "label": "Jaeger URL", "type": "textbox", "query": "http://jaeger-query:16686",
             "current": {"text": "http://jaeger-query:16686", "value": "http://jaeger-query:16686"}, "hide": 0,
             "description": "Where the mismatch panels' data links search for the failing spans."},
        ]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }


INTEGRITY = dashboard("kvgate-integrity", "kvgate / Integrity", "KV handoff integrity: every handoff decode refused, rejections, refused rollouts.", [
    jaeger_link(panel("Handoff mismatches in range", "Handoffs decode refused in the selected time range (any reason). Anything above zero is a KV integrity violation that kvgate caught: see the runbook KvgateHandoffIntegrityViolation. The data link opens the failing spans in Jaeger (the $jaeger variable).", "short",
          [(f"sum(increase(kvgate_handoff_mismatch_total{{{W}}}[$__range])) or vector(0)", "mismatches")], kind="stat",
          thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}], w=6), by_reason=False),
    jaeger_link(panel("Handoff mismatches by reason", "Rate of handoffs decode refused on evidence of bad KV, by reason: token_count, checksum, page_set, auth, fingerprint, timeout, unknown_handoff, rejected_forwarded, first_token, protocol, tenant (KV sealed for another tenant than the reservation's). A series' data link opens the traces of its refusals in Jaeger.", "ops",
          [(f"sum by (reason) (rate(kvgate_handoff_mismatch_total{{{W}}}[$__rate_interval]))", "{{reason}}")], w=18), by_reason=True),
    panel("Handoff mismatches by tenant", "The same refusals by the tenant whose request they hit (an API key's or a trusted gateway's tenant, a client address where nobody is authenticated; the first 16 tenants by name, the rest `other`): whose answers a bad transfer would have touched.", "ops",
          [(f"sum by (tenant, reason) (rate(kvgate_handoff_mismatch_by_tenant_total{{{W}}}[$__rate_interval]))", "{{tenant}} {{reason}}")]),
    panel("KV port refusals by reason", "Abuse or noise, not corruption: frames or connections decode's KV port refused that nobody holding the secret sent (malformed, too_large, unauthenticated), or beyond its limits (connection_limit, read_timeout). See the runbook KvgateKVPortAbuse.", "ops",
          [(f"sum by (reason) (rate(kvgate_kv_port_rejected_total{{{W}}}[$__rate_interval]))", "{{reason}}")]),
    panel("Internal requests refused by reason", "Calls to the workers' internal API without a valid signature of the deployment (missing, malformed, stale, replayed, bad_mac), signed for another worker process (wrong_target), with another body than signed (body_mismatch), or over the body limit or deadline (too_large, too_slow). See the runbook KvgateInternalRequestsRefused.", "reqps",
          [(f"sum by (role, reason) (rate(kvgate_internal_requests_rejected_total{{{W}}}[$__rate_interval]))", "{{role}} {{reason}}")]),
    panel("Handoff outcomes", "Handoffs per second by outcome: committed (verified and decoded), rejected (cancelled after prefill rejected the prompt), failed.", "ops",
          [(f"sum by (outcome) (rate(kvgate_handoff_total{{{W}, role=\"decode\"}}[$__rate_interval]))", "{{outcome}}")]),
    panel("Reservations cancelled and expired", "Decode reservations freed unused: cancelled (prefill rejected the prompt or refused the reservation) or expired (no frame arrived before the handoff timeout, or committed but never decoded).", "ops",
          [(f"sum(rate(kvgate_handoff_reservations_cancelled_total{{{W}}}[$__rate_interval]))", "cancelled"),
           (f"sum(rate(kvgate_handoff_reservations_expired_total{{{W}}}[$__rate_interval]))", "expired")]),
    panel("Requests rejected by reason", "Requests refused before any KV was touched: context_length_exceeded, prompt_too_large, pool_busy, invalid_request.", "reqps",
          [(f"sum by (reason) (rate(kvgate_requests_rejected_total{{{W}}}[$__rate_interval]))", "{{reason}}")]),
    panel("Rollouts refused by reason", "Revisions the operator's rollout gate refused, by reason (KVPoolBelowContextWindow, FingerprintMismatch, CanaryFailed, BoundaryProbeAnswered, HostPathNotAllowed). Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "short",
          [("sum by (reason) (increase(kvgate_operator_rollouts_refused_total[$__range]))", "{{reason}}")], kind="stat",
          thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]),
    panel("Probe mismatches", "Pairs or pods the operator's probes caught in the selected range, by engine, role and probe: boundary (a prompt past the window answered instead of refused) and stale_kv (other tokens for the same prompt after other prompts filled the pool). Anything above zero is the incident's failure caught before traffic: see the runbook KvgateProbeMismatch. Cluster-wide: the operator's own series carry no namespace or deployment label.", "short",
          [("sum by (engine, role, probe) (increase(kvgate_operator_probe_mismatches_total[$__range]))", "{{engine}} {{role}} {{probe}}")], kind="stat",
          thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
    panel("Connections refused by listener and reason", "Saturation, not corruption: connections a worker's listener closed unserved: over its cap (connection_limit), over one client address's share (client_limit: silent newcomers, or ones that found no idle connection to replace in time), KV connections that never authenticated (unauthenticated), or idle connections whose place a newcomer of the same address took (evicted). Clients within their share are still served. See the runbook KvgateListenerSaturated.", "ops",
          [(f"sum by (role, listener, reason) (rate(kvgate_connections_refused_total{{{W}}}[$__rate_interval]))", "{{role}} {{listener}} {{reason}}")], w=24),
])

CAPACITY = dashboard("kvgate-capacity", "kvgate / Capacity", "Measured KV pools against declared context windows, and pool use per pod.", [
    panel("Measured KV pool vs context window", "Smallest measured KV pool of the serving revision per role, against the declared context window. A pool line below the window line is the incident's condition; the operator refuses such revisions.", TOKENS,
          [(f"min by (name, role) (kvgate_operator_kv_pool_capacity_tokens{{{OP}}})", "{{name}} {{role}} pool"),
           (f"max by (name) (kvgate_operator_context_window_tokens{{{OP}}})", "{{name}} context window")]),
    panel("Pool headroom over the window", "Measured pool minus declared window, per deployment and role: below zero means a pod cannot hold one full-window request.", TOKENS,
          [(f"min by (name, role) (kvgate_operator_kv_pool_capacity_tokens{{{OP}}}) - on (name) group_left max by (name) (kvgate_operator_context_window_tokens{{{OP}}})", "{{name}} {{role}}")],
          thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 0}]),
    panel("Pool used vs capacity per pod", "Tokens of KV pool held by live sequences, and each pod's measured capacity.", TOKENS,
          [(f"sum by (pod, role) (kvgate_kv_pool_used_tokens{{{W}}})", "{{pod}} used"),
           (f"sum by (pod, role) (kvgate_kv_pool_capacity_tokens{{{W}}})", "{{pod}} capacity")]),
    panel("Pool utilisation per pod", "Used / capacity of each pod's KV pool.", "percentunit",
          [(f"sum by (pod) (kvgate_kv_pool_used_tokens{{{W}}}) / sum by (pod) (kvgate_kv_pool_capacity_tokens{{{W}}})", "{{pod}}")]),
    panel("Pages in use", "KV pages held by live sequences and pages allocated, per pod.", "short",
          [(f"sum by (pod) (kvgate_kv_pool_pages_in_use{{{W}}})", "{{pod}} in use"),
           (f"sum by (pod) (kvgate_kv_pool_pages{{{W}}})", "{{pod}} allocated")], w=24),
])

R = f'{W}, role=~"router|local"'
SERVING = dashboard("kvgate-serving", "kvgate / Serving", "Requests, latency, throughput and handoff traffic.", [
    panel("Requests by status code", "Requests answered by the routers (or colocated workers) per second, by HTTP status code.", "reqps",
          [(f"sum by (code) (rate(kvgate_requests_total{{{R}}}[$__rate_interval]))", "{{code}}")]),
    panel("Error ratio", "Share of requests answered with a non-2xx status.", "percentunit",
          [(f"sum(rate(kvgate_requests_total{{{R}, code!~\"2..\"}}[$__rate_interval])) / sum(rate(kvgate_requests_total{{{R}}}[$__rate_interval]))", "errors")]),
    panel("Router retries by reason", "Requests a router sent to another prefill/decode pair because a peer failed before any byte reached the client: decode_unreachable, prefill_failed, decode_stream_broke, handoff_timeout (decode refused a late transfer). Retried requests are answered whole; a steady rate points at peers dying or refusing calls.", "reqps",
          [(f"sum by (reason) (rate(kvgate_router_retries_total{{{W}}}[$__rate_interval]))", "{{reason}}")], w=24),
    panel("Time to first token by role", "From arrival to the first generated token, p50/p90/p99 per role: the router's is what clients see (admission, prefill, handoff and the first decode step); decode's starts when the verified handoff is handed to its scheduler.", "s",
          quantiles("kvgate_time_to_first_token_seconds", W, by="role"), w=8),
    panel("Inter-token latency by role", "Between consecutive tokens of one request, p50/p90/p99 per role: decode's step time, and what the router's clients see of it.", "s",
          quantiles("kvgate_inter_token_latency_seconds", W, by="role"), w=8),
    jaeger_slow(panel("Request duration", "From arrival to the last token: p50, p90, p99. The data link opens the traces of requests at least as slow as the point clicked (exemplars are not used: the Prometheus client kvgate uses does not export them).", "s", quantiles("kvgate_request_duration_seconds", R), w=8)),
    panel("Tokens per second", "Prompt tokens admitted and tokens generated per second.", "suffix: tokens/s",
          [(f"sum(rate(kvgate_prompt_tokens_total{{{R}}}[$__rate_interval]))", "prompt"),
           (f"sum(rate(kvgate_generation_tokens_total{{{R}}}[$__rate_interval]))", "generated")], w=8),
    panel("Handoff throughput", "KV bytes moved from prefill to decode per second.", "Bps",
          [(f"sum by (role) (rate(kvgate_handoff_bytes_total{{{W}}}[$__rate_interval]))", "{{role}}")], w=8),
    panel("Handoff duration", "Reservation to verified commit (decode) and transfer to ack (prefill): p50, p90, p99.", "s",
          quantiles("kvgate_handoff_duration_seconds", W, by="role"), w=8),
    panel("Handoff size", "KV page bytes of one handoff: acknowledged (prefill) and verified and committed (decode), p50, p90, p99. The two agree unless handoffs fail.", "bytes",
          quantiles("kvgate_handoff_size_bytes", W, by="role"), w=8),
    # The busiest tenants (the routers label the first 16 tenants by name, the rest `other`).
    panel("Busiest tenants by tokens", "Prompt + generated tokens per second of the 10 busiest tenants (an API key's or a trusted gateway's tenant; a client address where nobody is authenticated). Routers label the first 16 tenants they see (those with API keys first) by name and count the rest as `other`.", "suffix: tokens/s",
          [(f"topk(10, sum by (tenant) (rate(kvgate_tenant_tokens_total{{{R}}}[$__rate_interval])))", "{{tenant}}")], w=8),
    panel("Requests by tenant and status", "Answers per second by tenant and HTTP status code, for the 10 busiest tenant/code pairs: 401 a missing or unknown API key (tenant `unauthenticated`), 429 a tenant over its share in flight or its token quota.", "reqps",
          [(f"topk(10, sum by (tenant, code) (rate(kvgate_tenant_requests_total{{{R}}}[$__rate_interval])))", "{{tenant}} {{code}}")], w=8),
    panel("Tenant refusals by reason", "Requests turned away before they were served, by tenant and reason: unauthenticated (no or unknown API key, or not from the trusted gateway), in_flight (over --max-requests-per-client), token_quota (over the tenant's tokens per minute).", "reqps",
          [(f"sum by (tenant, reason) (rate(kvgate_tenant_refusals_total{{{R}}}[$__rate_interval]))", "{{tenant}} {{reason}}")], w=8),
])

OPERATOR = dashboard("kvgate-operator", "kvgate / Operator", "The kvgate operator: reconciles, latency, rollout phases, canaries, rollbacks, refused rollouts, unverified serving pods, leadership.", [
    panel("Reconciles by result", "Reconciles of InferenceDeployments per second, success or error. Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "ops",
          [("sum by (result) (rate(kvgate_operator_reconcile_total[$__rate_interval]))", "{{result}}")]),
    panel("Reconcile latency", "Time one reconcile takes: p50, p90, p99. Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "s", quantiles("kvgate_operator_reconcile_duration_seconds", "")),
    panel("Refused rollouts", "Revisions refused by the rollout gate in the selected range, by reason. Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "short",
          [("sum by (reason) (increase(kvgate_operator_rollouts_refused_total[$__range]))", "{{reason}}")], kind="stat",
          thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}], w=8),
    panel("Deployments refused now", "InferenceDeployments whose spec's revision stands refused (the previous revision, if any, keeps serving).", "short",
          [(f"kvgate_operator_rollout_refused{{{OP}}} == 1", "{{namespace}}/{{name}} {{reason}}")], kind="table", w=8),
    panel("Rollout phase", "Each InferenceDeployment's phase: Progressing (pools being verified), Canary (the integrity canary runs on the candidate), Baking (promoted, the previous revision kept beside it), Available, Degraded (serving, a serving pod out of the Service), RolledBack, Refused.", "short",
          [(f"kvgate_operator_rollout_phase{{{OP}}} == 1", "{{namespace}}/{{name}} {{phase}}")], kind="table", w=8),
    panel("Serving pods unverified", "Pods of the serving revision that failed re-verification (restarted with a smaller pool or other fingerprints): out of the EndpointSlices; the deployment is Degraded.", "short",
          [(f"max by (namespace, name) (kvgate_operator_serving_pods_unverified{{{OP}}})", "{{namespace}}/{{name}}")], kind="stat",
          thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}], w=8),
    panel("Rollbacks", "Promoted revisions rolled back during their bake in the selected range, by reason. Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "short",
          [("sum by (reason) (increase(kvgate_operator_rollbacks_total[$__range]))", "{{reason}}")], kind="stat",
          thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}], w=8),
    panel("Integrity canaries", "Integrity canaries run on candidate revisions in the selected range, passed or failed. Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "short",
          [("sum by (result) (increase(kvgate_operator_canary_runs_total[$__range]))", "{{result}}")], kind="stat", w=8),
    panel("Leader", "1 for the operator replica that reconciles: the holder of the leader Lease when the chart runs more than one replica (leader election), else the only replica. Cluster-wide: the operator's own series carry no namespace or deployment label, so the dashboard's variables do not filter this panel.", "bool",
          [("max by (pod, instance) (kvgate_operator_leader)", "{{pod}} {{instance}}")], kind="stat", w=8),
])

FILES = {"integrity.json": INTEGRITY, "capacity.json": CAPACITY, "serving.json": SERVING, "operator.json": OPERATOR}


def main():
    check = "--check" in sys.argv
    stale = []
    for name, d in FILES.items():
        text = json.dumps(d, indent=2) + "\n"
        path = HERE / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        sys.exit(f"stale dashboards {stale}: run make generate")


if __name__ == "__main__":
    main()
