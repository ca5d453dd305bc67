//! The integrity canary: before a candidate revision's pods take traffic, the operator drives
//! fixed greedy prompts through every candidate prefill x decode pair itself, over the path the
//! router uses (`pair.rs`). Checksums prove a transfer arrived as sent; only comparing outputs
//! proves that prefill computed the right KV and that decode read it where it landed.
//!
//! The revision passes only if every pair answers, every pair gives the same tokens for each
//! prompt, those equal what a serving pair gives when the serving revision has the same model
//! and KV layout, and no candidate pod's `kvgate_handoff_mismatch_total` moved.

mod pair;
pub mod prompts;

pub use pair::Endpoint;

use kvgate_proto::auth::DeploymentKey;
use kvgate_proto::contract::{DECODE_PORT, PREFILL_PORT};

use crate::crd::CanaryStatus;
use crate::scrape;

/// One canary run, as decided from what a reconcile observed (pure data).
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryRun {
    pub revision: String,
    pub prefill: Vec<Endpoint>,
    pub decode: Vec<Endpoint>,
    /// A serving revision with the same model and layout, one of its pairs, and the window it
    /// was verified for (longer prompts are compared among the candidate's pairs only).
    pub reference: Option<Reference>,
    pub prompts: u32,
    pub page_size: u32,
    pub max_prompt_tokens: u64,
    pub vocab: u32,
    pub max_tokens: u32,
}

/// A serving revision the candidate's outputs must equal.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub revision: String,
    pub prefill: Endpoint,
    pub decode: Endpoint,
    pub context_window: u64,
}

/// Runs the canary; the status to record for the revision.
pub async fn run(http: &reqwest::Client, key: &DeploymentKey, run: &CanaryRun) -> CanaryStatus {
    let result = check(http, key, run).await;
    CanaryStatus { revision: run.revision.clone(), passed: result.is_ok(), message: result.unwrap_or_else(|e| e) }
}

fn pair_name(prefill: &Endpoint, decode: &Endpoint) -> String {
    format!("prefill {} x decode {}", prefill.pod, decode.pod)
}

/// Where two outputs first differ.
fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
}

fn token_at(tokens: &[u32], i: usize) -> String {
    tokens.get(i).map_or_else(|| "the end of its output".to_string(), |t| format!("token id {t}"))
}

async fn check(http: &reqwest::Client, key: &DeploymentKey, run: &CanaryRun) -> Result<String, String> {
    let pods: Vec<(&Endpoint, u16)> = run.prefill.iter().map(|e| (e, PREFILL_PORT)).chain(run.decode.iter().map(|e| (e, DECODE_PORT))).collect();
    let before = mismatches(http, &pods).await?;
    let prompts = prompts::prompts(run.prompts, run.page_size, run.max_prompt_tokens, run.vocab);
    // What each prompt must give: the serving revision's output, else the first pair's.
    let mut want: Vec<Option<(String, Vec<u32>)>> = vec![None; prompts.len()];
    if let Some(r) = &run.reference {
        let by = format!("serving revision {} ({})", r.revision, pair_name(&r.prefill, &r.decode));
        let fits = |p: &Vec<u32>| p.len() as u64 + u64::from(run.max_tokens) <= r.context_window;
        for (w, prompt) in want.iter_mut().zip(&prompts).filter(|(_, p)| fits(p)) {
            let tokens = pair::generate(http, key, &r.prefill, &r.decode, prompt, run.max_tokens)
                .await
                .map_err(|e| format!("{by}, prompt of {} tokens: {e}", prompt.len()))?;
            *w = Some((by.clone(), tokens));
        }
    }
    for prefill in &run.prefill {
        for decode in &run.decode {
            let pair = pair_name(prefill, decode);
            for (w, prompt) in want.iter_mut().zip(&prompts) {
                let n = prompt.len();
                let got =
                    pair::generate(http, key, prefill, decode, prompt, run.max_tokens).await.map_err(|e| format!("pair {pair}, prompt of {n} tokens: {e}"))?;
                match w {
                    None => *w = Some((format!("pair {pair}"), got)),
                    Some((by, expected)) => {
                        if let Some(i) = first_difference(expected, &got) {
                            return Err(format!(
                                "pair {pair}, prompt of {n} tokens: output token {i} is {}, but {by} gave {}",
                                token_at(&got, i),
                                token_at(expected, i)
                            ));
                        }
                    }
                }
            }
        }
    }
    let after = mismatches(http, &pods).await?;
    for ((pod, was), (_, now)) in before.iter().zip(&after) {
        if now > was {
            return Err(format!("pod {pod} counted {} handoff mismatches during the canary (kvgate_handoff_mismatch_total {was} -> {now})", now - was));
        }
    }
    let lengths: Vec<String> = prompts.iter().map(|p| p.len().to_string()).collect();
    let compared = match &run.reference {
        Some(r) => format!(", equal to serving revision {}'s where they fit its window of {}", r.revision, r.context_window),
        None => String::new(),
    };
    Ok(format!(
        "{} prompts ({} tokens) x {} generated tokens through {} pairs: every pair gave the same tokens{compared}; no handoff mismatch",
        prompts.len(),
        lengths.join(", "),
        run.max_tokens,
        run.prefill.len() * run.decode.len()
    ))
}

/// Each pod's `kvgate_handoff_mismatch_total`, summed over reasons.
async fn mismatches(http: &reqwest::Client, pods: &[(&Endpoint, u16)]) -> Result<Vec<(String, f64)>, String> {
    let mut out = Vec::new();
    for (e, port) in pods {
        let text = scrape::metrics(http, &e.ip, *port).await.map_err(|why| format!("{why} (pod {})", e.pod))?;
        out.push((e.pod.clone(), scrape::family_by(&text, scrape::MISMATCHES, "reason").values().sum()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_differ_where_a_token_or_the_length_differs() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(token_at(&[1, 2], 2), "the end of its output");
    }
}
