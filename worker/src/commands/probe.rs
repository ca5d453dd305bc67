//! `kvgate-worker probe`: measure the pool as serving would, compare with the window, exit.

use anyhow::bail;

use crate::cli::ProbeArgs;
use crate::setup;

pub fn run(args: ProbeArgs) -> anyhow::Result<()> {
    let loaded = setup::load(&args.engine)?;
    let r = &loaded.report;
    if args.json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        println!("model            {} ({})", r.model, r.model_fingerprint);
        println!("device           {}", r.device);
        println!("kv dtype         {}", r.dtype);
        println!("page size        {} tokens", r.page_size);
        println!("pages            {}", r.num_pages);
        println!("bytes per token  {}", r.bytes_per_token);
        println!("capacity         {} tokens ({} bytes)", r.capacity_tokens, r.pool_bytes());
        println!("layout           {}", r.layout_fingerprint);
        println!("context window   {} tokens", args.engine.context_window);
    }
    let window = args.engine.context_window;
    if !r.holds(window) {
        bail!("KV pool measured {} tokens < context window {window} tokens", r.capacity_tokens);
    }
    Ok(())
}
