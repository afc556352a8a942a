//! `ferrotron sample` prints the text as it is generated: the pieces handed out one by one,
//! several of them, make up the returned text, the same with and without the KV cache.

mod common;
use common::{tiny_args, tmp};
use ferrotron_train::run::{run, sample_from};
use ferrotron_train::sample::SampleOptions;

#[test]
fn pieces_come_token_by_token_and_make_up_the_text() {
    let out = tmp("sample-stream");
    let mut a = tiny_args(&out, 2);
    a.checkpoint_dir = Some(out.join("ck"));
    run(a).unwrap();
    let o = SampleOptions {
        tokens: 12,
        temperature: 0.0,
        top_k: 0,
        seed: 1,
        context: usize::MAX,
        kv_cache: true,
    };
    let mut pieces = vec![];
    let text = sample_from(&out.join("ck"), "ROMEO:", &o, &mut |p| {
        pieces.push(p.to_string())
    })
    .unwrap();
    assert!(!text.is_empty());
    assert_eq!(pieces.concat(), text);
    assert!(pieces.len() > 1, "{pieces:?}");
    // Greedy sampling is deterministic: the same text without streaming.
    let again = sample_from(&out.join("ck"), "ROMEO:", &o, &mut |_| {}).unwrap();
    assert_eq!(again, text);
    // The same tokens recomputing the whole prefix for each (no KV cache).
    let plain = SampleOptions {
        kv_cache: false,
        ..o.clone()
    };
    assert_eq!(
        sample_from(&out.join("ck"), "ROMEO:", &plain, &mut |_| {}).unwrap(),
        text
    );
    // The context check: the tiny model's positions, and not one more.
    let mut long = o.clone();
    long.tokens = 1 << 20;
    let e = sample_from(&out.join("ck"), "ROMEO:", &long, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("pass the model's context of"), "{e}");
    // Up to the last position the context has: the cache holds them all, and the text is the
    // recomputed one.
    let most: usize = e
        .to_string()
        .rsplit("at most ")
        .next()
        .unwrap()
        .trim_end_matches(" tokens")
        .parse()
        .unwrap();
    let edge = SampleOptions {
        tokens: most,
        ..o.clone()
    };
    let cached = sample_from(&out.join("ck"), "ROMEO:", &edge, &mut |_| {}).unwrap();
    let edge = SampleOptions {
        kv_cache: false,
        ..edge
    };
    let plain = sample_from(&out.join("ck"), "ROMEO:", &edge, &mut |_| {}).unwrap();
    assert_eq!(cached, plain);
    assert!(cached.len() >= text.len(), "{cached:?}");
}
