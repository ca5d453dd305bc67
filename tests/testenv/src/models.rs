//! The engine tests' tiny random models, written by `tests/engines/models.sh` with the pinned
//! `gguf`, `numpy` and `safetensors` of `target/models-venv` (`make test-deps`).

use std::path::Path;
use std::process::Command;

/// What `models.sh` writes: a GGUF file, or a checkpoint directory in transformers' layout.
#[derive(Debug, Clone, Copy)]
pub enum Format {
    Gguf,
    Hf,
}

/// Writes the tiny Llama in `format` at `path` (its parent directories made first).
pub fn write(format: Format, path: &Path) {
    let script = crate::paths::root().join("tests/engines/models.sh");
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
    }
    let kind = match format {
        Format::Gguf => "gguf",
        Format::Hf => "hf",
    };
    let out = Command::new("bash").arg(&script).arg(kind).arg(path).output().unwrap_or_else(|e| panic!("bash {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "writing the tiny {kind} model at {}: {}{}",
        path.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
