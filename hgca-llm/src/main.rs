//! `hgca-llm`: perplexity, speed and generation with SmolLM2-135M (or any
//! Llama GGUF) through hgca's attention layers.

use clap::Parser;

use cli::{Cli, Cmd};

mod cli;
mod factory;
mod ffn_cmd;
mod generate;
mod load;
mod needle;
mod ppl_cmd;
mod progress;
mod ruler;
mod speed;

/// Prefill allocates and frees buffers of several MiB per layer (candle's
/// matmul outputs). glibc returns them to the kernel (mmap'd blocks and a
/// trimmed heap top), and each new one is faulted in and zeroed again.
/// Blocks up to 32 MiB (glibc's cap) come from the heap instead, and the
/// heap is not trimmed (measured through the equivalent GLIBC_TUNABLES:
/// Gemma 3's 2048-token prompt 5.3-5.9 s -> 4.4-4.9 s).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; no other thread
    // exists yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

fn main() {
    let cli = Cli::parse();
    // candle sizes its pools from these variables (it would take the
    // physical cores, not the ones this process may use).
    let threads = match cli.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let n = threads.to_string();
    // SAFETY: no other thread exists yet (candle and rayon start their
    // pools lazily, on first use below), so nothing reads the environment
    // concurrently.
    unsafe {
        std::env::set_var("CANDLE_NUM_THREADS", &n);
        std::env::set_var("RAYON_NUM_THREADS", &n);
    }
    keep_freed_memory();
    let r = match &cli.cmd {
        Cmd::Ppl(a) => ppl_cmd::cmd_ppl(&cli, a),
        Cmd::Needle(a) => needle::cmd_needle(&cli, a),
        Cmd::Ruler(a) => ruler::cmd_ruler(&cli, a),
        Cmd::Ffn(a) => ffn_cmd::cmd_ffn(&cli, a),
        Cmd::FfnProfile(a) => ffn_cmd::cmd_profile(&cli, a),
        Cmd::Speed {
            text,
            context,
            chunk,
            decode,
            attn,
            window_ratio,
            recovery,
        } => speed::cmd_speed(
            &cli,
            text,
            (*context, *chunk, *decode),
            *attn,
            *window_ratio,
            recovery,
        ),
        Cmd::Generate {
            prompt,
            max_tokens,
            chat,
            temperature,
            seed,
        } => generate::cmd_generate(&cli, prompt, *max_tokens, *chat, *temperature, *seed),
    };
    if let Err(e) = r {
        eprintln!("error: {}", hgca_kernels::report(&e));
        std::process::exit(1);
    }
}
