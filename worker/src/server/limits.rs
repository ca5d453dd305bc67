//! Request body limits, derived from the declared context window so that a prompt of the whole
//! window always fits (axum's fixed 2 MB default capped a 1M-token window at ~600k tokens).

/// Fixed room for everything in a body that is not the prompt.
const BASE: usize = 1 << 20;

/// Public API (`/v1/*`): the prompt as JSON text or token ids. 16 bytes a token covers a
/// token id with its comma (at most 11) and the text of a token with JSON escapes.
pub fn public_body(window: usize) -> usize {
    BASE.saturating_add(window.saturating_mul(16))
}

/// Internal calls between roles: the prompt as token ids (at most 11 bytes each) plus the
/// reservation's page ids (at most one page a token, 11 bytes each).
pub fn internal_body(window: usize) -> usize {
    BASE.saturating_add(window.saturating_mul(24))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_window_of_the_largest_token_ids_fits() {
        for window in [1, 8192, 1_048_576] {
            let ids = vec![u32::MAX; window];
            let prompt = serde_json::to_vec(&ids).unwrap();
            let body = serde_json::to_vec(&serde_json::json!({ "prompt": ids, "max_tokens": 1 })).unwrap();
            assert!(body.len() <= public_body(window), "{window}: {} > {}", body.len(), public_body(window));
            // Internally the prompt travels with a page id per token at worst.
            assert!(2 * prompt.len() <= internal_body(window));
        }
        assert_eq!(public_body(usize::MAX), usize::MAX, "saturates instead of wrapping");
    }
}
