//! `hgca-llm ruler` end to end on a tiny random GGUF (the CI's small data):
//! every task's documents are built, prefilled once for all variants,
//! asked and scored; the JSON holds a row per task and variant and one per
//! answer, consistent with the scoring rule; bad variant lists are refused.

use std::path::Path;
use std::process::Command;

use hgca_llm::synth::{SynthSpec, write_tiny_llama};

fn haystack(path: &Path) {
    // Sentences with full stops, so that needles go in at sentence ends.
    let words = [
        "the", "ring", "theme", "and", "a", "harbour", "walk", "letter",
    ];
    let mut text = String::from("Title page\n\nChapter 1\n\n");
    for i in 0..900 {
        text.push_str(words[(i * 7 + i / 5) % words.len()]);
        text.push(if i % 9 == 8 { '.' } else { ' ' });
        if i % 9 == 8 {
            text.push(' ');
        }
    }
    std::fs::write(path, text).unwrap();
}

fn ruler(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hgca-llm"))
        .args(["--model", dir.join("tiny.gguf").to_str().unwrap()])
        .args(["--weights", "f32", "--kv", "f32", "--threads", "2", "ruler"])
        .args(["--text", dir.join("hay.txt").to_str().unwrap()])
        .args(args)
        .output()
        .expect("run hgca-llm")
}

#[test]
fn ruler_runs_every_task_and_variant_and_scores_consistently() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_llama(dir.path().join("tiny.gguf"), &SynthSpec::default()).unwrap();
    haystack(&dir.path().join("hay.txt"));
    let json = dir.path().join("out.json");
    let out = ruler(
        dir.path(),
        &[
            "--contexts",
            "1000",
            "--docs",
            "1",
            "--variants",
            "full,mass:0.9@0.25,oracle:0.9@0.25,frozen@0.25",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("| task | variant | right |"), "{stdout}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let ctx = &doc["contexts"][0];
    assert_eq!(ctx["context"], 1000);
    let tasks = [
        "single",
        "multikey",
        "multivalue",
        "multiquery",
        "vartrack",
        "shift",
        "all",
    ];
    let variants = ["full", "mass:0.9@0.25", "oracle:0.9@0.25", "frozen@0.25"];
    let cells = ctx["cells"].as_array().unwrap();
    assert_eq!(cells.len(), tasks.len() * variants.len());
    // Questions per document: 1, 4, 2, 2, 2, 2.
    let questions = [1, 4, 2, 2, 2, 2, 13];
    for (t, &n) in tasks.iter().zip(&questions) {
        for v in variants {
            let c = cells
                .iter()
                .find(|c| c["task"] == *t && c["variant"] == v)
                .unwrap_or_else(|| panic!("no cell {t} {v}"));
            assert_eq!(c["questions"], n, "{t} {v}");
            if v == "full" {
                assert_eq!(c["same_as_full"], n, "full is its own yardstick");
                assert!(c["cpu_bytes_read_pct"].is_null());
            } else {
                // The hybrid layers decoded with a CPU store to select from.
                let sel = c["cpu_entries_selected_pct"].as_f64().unwrap();
                assert!(sel > 0.0 && sel <= 100.0, "{t} {v}: {sel}");
            }
        }
    }
    let answers = ctx["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 13 * variants.len());
    for a in answers {
        let turns = a["turns"].as_array().unwrap();
        let shift = a["task"] == "shift";
        assert_eq!(turns.len(), if shift { 2 } else { 1 }, "{a}");
        let mut all = true;
        for t in turns {
            let right = t["right"].as_bool().unwrap();
            all &= right;
            if matches!(a["task"].as_str(), Some("single" | "multikey" | "shift")) {
                // One number expected: right iff the answer's first run of
                // digits is it.
                let ans = t["answer"].as_str().unwrap();
                let first: String = ans
                    .chars()
                    .skip_while(|c| !c.is_ascii_digit())
                    .take_while(|c| c.is_ascii_digit())
                    .collect();
                assert_eq!(right, first == t["expect"].as_str().unwrap(), "{t}");
            }
        }
        assert_eq!(a["right"], all, "{a}");
    }
}

#[test]
fn ruler_refuses_bad_variant_lists() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_llama(dir.path().join("tiny.gguf"), &SynthSpec::default()).unwrap();
    haystack(&dir.path().join("hay.txt"));
    for (variants, says) in [
        ("mass:0.9@0.25", "`full`"),
        ("full,mass:0.9", "RULE@RATIO"),
        ("full,mass:0.9@1.5", "the ratio"),
        ("full,nonsense@0.25", "expected frozen"),
    ] {
        let out = ruler(dir.path(), &["--contexts", "1000", "--variants", variants]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{variants}: {stderr}");
        assert!(stderr.contains(says), "{variants}: {stderr}");
    }
    // A context the haystack cannot fill.
    let out = ruler(dir.path(), &["--contexts", "100000"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--contexts"),
        "{stderr}"
    );
}
