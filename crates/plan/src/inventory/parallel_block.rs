//! The inventories of the parallel-block families, in HF order and naming: GPT-NeoX / Pythia
//! (`GPTNeoXForCausalLM`) and GPT-J (`GPTJForCausalLM`). Both use nn.Linear ([out, in]) and
//! LayerNorm with a bias.

use super::{Builder, Placement, COL, ROW};
use crate::model::ModelSpec;

impl Builder {
    /// A LayerNorm's weight and bias.
    fn layer_norm(&mut self, name: &str, width: u64, p: Placement) {
        self.norm(format!("{name}.weight"), width, p);
        self.norm(format!("{name}.bias"), width, p);
    }

    /// The GeLU MLP `fc_in` → gelu → `fc_out` under the given names, with biases.
    fn gelu_mlp(&mut self, up: &str, down: &str, m: &ModelSpec, p: Placement) {
        let (c, f) = (m.hidden, m.intermediate);
        self.linear(up, [f, c], p, COL, m.mlp_bias);
        self.linear(down, [c, f], p, ROW, m.mlp_bias);
    }
}

/// `gpt_neox.embed_in`, per layer `input_layernorm`, `post_attention_layernorm`,
/// `attention.query_key_value` [3h, h] (per-head interleaved q, k, v: a column split by
/// heads), `attention.dense`, `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`; `final_layer_norm`,
/// `embed_out`. (Older checkpoints also store `attention.bias`, `attention.masked_bias` and
/// `rotary_emb.inv_freq`: buffers, not parameters.)
pub(super) fn neox(m: &ModelSpec, b: &mut Builder) {
    let (c, v) = (m.hidden, m.vocab);
    let embed = "gpt_neox.embed_in.weight";
    b.push(embed.into(), &[v, c], Placement::Embedding, COL);
    for i in 0..m.layers {
        let p = Placement::Layer(i);
        let l = format!("gpt_neox.layers.{i}");
        b.layer_norm(&format!("{l}.input_layernorm"), c, p);
        b.layer_norm(&format!("{l}.post_attention_layernorm"), c, p);
        let at = format!("{l}.attention");
        b.linear(
            &format!("{at}.query_key_value"),
            [3 * c, c],
            p,
            COL,
            m.qkv_bias,
        );
        b.linear(&format!("{at}.dense"), [c, c], p, ROW, m.o_bias);
        b.gelu_mlp(
            &format!("{l}.mlp.dense_h_to_4h"),
            &format!("{l}.mlp.dense_4h_to_h"),
            m,
            p,
        );
    }
    b.layer_norm("gpt_neox.final_layer_norm", c, Placement::Head);
    if !m.tie_embeddings {
        b.push("embed_out.weight".into(), &[v, c], Placement::Head, COL);
    }
}

/// `transformer.wte`, per layer `ln_1`, `attn.{q,k,v,out}_proj` (no biases), `mlp.fc_in`,
/// `mlp.fc_out`; `transformer.ln_f`, `lm_head` with its bias (`GPTJForCausalLM`:
/// `nn.Linear(n_embd, vocab_size)`).
pub(super) fn gptj(m: &ModelSpec, b: &mut Builder) {
    let (c, v) = (m.hidden, m.vocab);
    b.push(
        "transformer.wte.weight".into(),
        &[v, c],
        Placement::Embedding,
        COL,
    );
    for i in 0..m.layers {
        let p = Placement::Layer(i);
        let h = format!("transformer.h.{i}");
        b.layer_norm(&format!("{h}.ln_1"), c, p);
        for proj in ["q_proj", "k_proj", "v_proj"] {
            b.linear(&format!("{h}.attn.{proj}"), [c, c], p, COL, m.qkv_bias);
        }
        b.linear(&format!("{h}.attn.out_proj"), [c, c], p, ROW, m.o_bias);
        b.gelu_mlp(&format!("{h}.mlp.fc_in"), &format!("{h}.mlp.fc_out"), m, p);
    }
    b.layer_norm("transformer.ln_f", c, Placement::Head);
    if !m.tie_embeddings {
        b.linear("lm_head", [v, c], Placement::Head, COL, true);
    }
}
