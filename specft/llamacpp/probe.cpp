// specft-llama-probe: the target's numbers as llama.cpp computes them, for specft's checks.
//
// Built by scripts/install_llamacpp.sh against the installed libllama (its own headers),
// so it computes with exactly the kernels llama-server runs. For each input sequence it
// writes the logits of every position (and the inputs of the requested decoder layers,
// what llama.cpp hands an EAGLE-3 draft), either teacher-forced or while decoding greedily.
//
//   specft-llama-probe MODEL.gguf IN.txt OUT_DIR [--ubatch N] [--gen N] [--layers 2,15,27]
//                      [--threads N] [--fa on|off|auto] [--ctx N] [--logits 0|1] [--final 0|1]
//
// IN.txt: one sequence per line, token ids separated by spaces. OUT_DIR/ gets
//   logits.f32  [rows, n_vocab] float32, rows of all sequences one after another (not
//               with --logits 0: stage 1 needs the features only, and a vocabulary-wide
//               row per token would be most of the bytes)
//   hidden.f32  [rows, n_layers, n_embd] float32 (only with --layers)
//   final.f32   [rows, n_embd] float32, the final norm's output that the lm_head reads
//               (only with --final 1: the context then also returns embeddings)
//   tokens.txt  one line per sequence: the tokens the rows' logits predict after
//               (teacher-forced: the input shifted by one; --gen: the greedy tokens)
//   meta.json   rows per sequence, n_vocab, n_embd, layers, options
// --ubatch N feeds the sequence N tokens per llama_decode (1: token by token, as decoding;
// 0: all at once, as prompt processing). --gen N: the prompt at once, then N greedy tokens
// one at a time, logits recorded for the last prompt position and each generated token.

#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

struct Options {
    int ubatch = 0;
    int gen = 0;
    int threads = 2;
    int ctx = 4096;
    std::string fa = "auto";
    std::vector<int> layers;
    bool logits = true;
    bool final = false;
};

static std::vector<int> parse_ints(const std::string & text, char sep) {
    std::vector<int> out;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, sep)) {
        if (!item.empty()) {
            out.push_back(std::atoi(item.c_str()));
        }
    }
    return out;
}

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

struct Writer {
    FILE * logits = nullptr;
    FILE * hidden = nullptr;
    FILE * final = nullptr;
    int n_vocab = 0;
    int n_embd = 0;
};

// One llama_decode of tokens[begin, end) at positions begin.., every row an output.
static bool decode_rows(llama_context * ctx, const std::vector<llama_token> & tokens, int begin, int end,
                        const Options & opt, Writer & w) {
    const int n = end - begin;
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        batch.token[i] = tokens[begin + i];
        batch.pos[i] = begin + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    const int rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    if (rc != 0) {
        fprintf(stderr, "specft-llama-probe: llama_decode failed (%d)\n", rc);
        return false;
    }
    for (int i = 0; i < n; ++i) {
        if (w.logits) {
            fwrite(llama_get_logits_ith(ctx, i), sizeof(float), w.n_vocab, w.logits);
        }
        if (w.final) {
            fwrite(llama_get_embeddings_ith(ctx, i), sizeof(float), w.n_embd, w.final);
        }
        for (int layer : opt.layers) {
            const float * rows = llama_get_embeddings_layer_inp(ctx, (uint32_t) layer);
            fwrite(rows + (size_t) i * w.n_embd, sizeof(float), w.n_embd, w.hidden);
        }
    }
    return true;
}

static int argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
        if (row[i] > row[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: specft-llama-probe MODEL.gguf IN.txt OUT_DIR [--ubatch N] [--gen N] "
                        "[--layers a,b,c] [--threads N] [--fa on|off|auto] [--ctx N] [--logits 0|1] [--final 0|1]\n");
        return 2;
    }
    const std::string model_path = argv[1], in_path = argv[2], out_dir = argv[3];
    Options opt;
    for (int i = 4; i + 1 < argc; i += 2) {
        const std::string key = argv[i], value = argv[i + 1];
        if (key == "--ubatch") opt.ubatch = std::atoi(value.c_str());
        else if (key == "--gen") opt.gen = std::atoi(value.c_str());
        else if (key == "--threads") opt.threads = std::atoi(value.c_str());
        else if (key == "--ctx") opt.ctx = std::atoi(value.c_str());
        else if (key == "--fa") opt.fa = value;
        else if (key == "--layers") opt.layers = parse_ints(value, ',');
        else if (key == "--logits") opt.logits = value != "0";
        else if (key == "--final") opt.final = value != "0";
        else { fprintf(stderr, "specft-llama-probe: unknown option %s\n", key.c_str()); return 2; }
    }

    std::vector<std::vector<llama_token>> sequences;
    {
        std::ifstream in(in_path);
        std::string line;
        while (std::getline(in, line)) {
            std::vector<int> ids = parse_ints(line, ' ');
            if (!ids.empty()) sequences.emplace_back(ids.begin(), ids.end());
        }
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
    if (!model) { fprintf(stderr, "specft-llama-probe: cannot load %s\n", model_path.c_str()); return 1; }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = opt.ctx;
    cp.n_batch = opt.ctx;
    cp.n_ubatch = opt.ctx;
    cp.n_threads = opt.threads;
    cp.n_threads_batch = opt.threads;
    // embeddings on: every row also returns the final norm's output (pooling none keeps
    // one per token); the logits are computed either way
    cp.embeddings = opt.final;
    cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
    cp.flash_attn_type = opt.fa == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                       : opt.fa == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "specft-llama-probe: cannot create a context\n"); return 1; }
    for (int layer : opt.layers) llama_set_embeddings_layer_inp(ctx, (uint32_t) layer, true);

    Writer w;
    w.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    w.n_embd = llama_model_n_embd(model);
    w.logits = opt.logits ? fopen((out_dir + "/logits.f32").c_str(), "wb") : nullptr;
    w.hidden = opt.layers.empty() ? nullptr : fopen((out_dir + "/hidden.f32").c_str(), "wb");
    w.final = opt.final ? fopen((out_dir + "/final.f32").c_str(), "wb") : nullptr;
    FILE * tokens_out = fopen((out_dir + "/tokens.txt").c_str(), "w");
    if ((opt.logits && !w.logits) || !tokens_out || (!opt.layers.empty() && !w.hidden) || (opt.final && !w.final)) {
        fprintf(stderr, "specft-llama-probe: cannot write to %s\n", out_dir.c_str());
        return 1;
    }

    std::vector<int> rows;
    std::vector<float> last(w.n_vocab);
    for (auto tokens : sequences) {
        llama_memory_clear(llama_get_memory(ctx), true);
        int n_rows = 0;
        std::string predicted;
        if (opt.gen > 0) {
            // the prompt at once; only its last row is kept, then one token at a time
            const int n_prompt = (int) tokens.size();
            std::vector<llama_token> prompt(tokens.begin(), tokens.end() - 1);
            if (!prompt.empty()) {
                llama_batch batch = llama_batch_get_one(prompt.data(), (int) prompt.size());
                if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "specft-llama-probe: prompt failed\n"); return 1; }
            }
            for (int step = 0; step <= opt.gen - 1; ++step) {
                const int pos = n_prompt - 1 + step;
                if (!decode_rows(ctx, tokens, pos, pos + 1, opt, w)) return 1;
                ++n_rows;
                const int next = argmax(llama_get_logits_ith(ctx, 0), w.n_vocab);
                predicted += (predicted.empty() ? "" : " ") + std::to_string(next);
                tokens.push_back(next);
                if (llama_vocab_is_eog(llama_model_get_vocab(model), next)) break;
            }
        } else {
            const int n = (int) tokens.size();
            const int step = opt.ubatch > 0 ? opt.ubatch : n;
            for (int begin = 0; begin < n; begin += step) {
                const int end = begin + step < n ? begin + step : n;
                if (!decode_rows(ctx, tokens, begin, end, opt, w)) return 1;
            }
            n_rows = n;
            for (int i = 1; i < n; ++i) predicted += (i > 1 ? " " : "") + std::to_string(tokens[i]);
        }
        rows.push_back(n_rows);
        fprintf(tokens_out, "%s\n", predicted.c_str());
    }
    if (w.logits) fclose(w.logits);
    if (w.hidden) fclose(w.hidden);
    if (w.final) fclose(w.final);
    fclose(tokens_out);

    FILE * meta = fopen((out_dir + "/meta.json").c_str(), "w");
    fprintf(meta, "{\"n_vocab\": %d, \"n_embd\": %d, \"ubatch\": %d, \"gen\": %d, \"fa\": \"%s\", "
                  "\"threads\": %d, \"layers\": [", w.n_vocab, w.n_embd, opt.ubatch, opt.gen, opt.fa.c_str(),
            opt.threads);
    for (size_t i = 0; i < opt.layers.size(); ++i) fprintf(meta, "%s%d", i ? ", " : "", opt.layers[i]);
    fprintf(meta, "], \"rows\": [");
    for (size_t i = 0; i < rows.size(); ++i) fprintf(meta, "%s%d", i ? ", " : "", rows[i]);
    fprintf(meta, "]}\n");
    fclose(meta);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
