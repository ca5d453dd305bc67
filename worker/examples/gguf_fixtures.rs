//! Writes the random-weight GGUF files of `tests/fixtures/gguf-reference/` (Llama and Qwen2, in
//! Q8_0 and in Q4_K_M's mix) with the writer the GGUF tests use. `make.py` there runs this, then
//! has transformers compute the references from the same files.
//!
//!   cargo run -p kvgate-worker --example gguf_fixtures -- DIR

#[path = "../tests/support/gguf_files.rs"]
mod gguf_files;

use gguf_files::{Family, Mix, Shape, write};

/// Small enough to check in (about 3 MB for the four), wide enough for Q4_K's 256-value blocks.
const SHAPE: Shape = Shape { hidden: 256, ffn: 256, heads: 4, kv_heads: 2, layers: 2, vocab: 300 };

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: gguf_fixtures DIR"));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for family in [Family::Llama, Family::Qwen2] {
        for mix in [Mix::Q8_0, Mix::Q4KM] {
            let path = dir.join(format!("{family:?}-{mix:?}.gguf").to_lowercase());
            write(&path, SHAPE, family, mix);
            println!("{}", path.display());
        }
    }
}
