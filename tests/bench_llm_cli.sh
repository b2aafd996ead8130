#!/usr/bin/env bash
# The contract of tp-bench-llm on its tiny model (a few seconds): a bad
# command line exits 2 with the usage; a run at tp 1, 2, 4 (one timed pass)
# prints a row per tp and pass with a positive time, writes the CSV, and
# skips a tp that does not divide the heads; --dump-config writes a
# config.json tp-bench-llm reads back, and the 8b-layer and 8b-stack
# presets have Llama-3-8B's sizes; --save writes a sharded checkpoint,
# --model runs on its weights, and --load times it and prints the disk and
# memory tables. --device cuda for the passes: without a CUDA device it
# exits 1 saying so (not 2: the command line is good); with one, a small
# GQA model in bf16 at tp 1 and 2 prints the pass by hand and its CSV
# columns. --dtype bf16|f16 of the passes is CUDA's: on the CPU, exit 2.
#   tests/bench_llm_cli.sh BUILD/bench/tp-bench-llm
set -uo pipefail
bench=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

for args in "--config nope" "-r 0" "--tp 0" "--tp x" "-p bwd" "--bogus" "-b" \
            "--threads 0" "--backend tcp" "--save $tmp/a --load $tmp/b" "--load $tmp/none" \
            "--device gpu" "--dtype bf16 -p fwd" "--dtype f16 -p fwd+bwd --config tiny" \
            "-p train --device cuda" "--dump-config $tmp/x.json --device cuda"; do
    # shellcheck disable=SC2086
    "$bench" $args >"$tmp/out" 2>&1
    rc=$?
    [ $rc -eq 2 ] || fail "'$args' exits $rc, not 2: $(head -c 300 "$tmp/out")"
done
"$bench" --bogus >"$tmp/out" 2>&1
grep -q "usage:" "$tmp/out" || fail "--bogus prints no usage"
grep -q -- "--bogus" "$tmp/out" || fail "--bogus: the message does not name it"
"$bench" --help >"$tmp/out" 2>&1 || fail "--help exits $?"
grep -q "usage:" "$tmp/out" || fail "--help prints no usage"
"$bench" --dtype bf16 -p fwd >"$tmp/out" 2>&1
grep -q -- "--dtype bf16|f16 of -p fwd, fwd+bwd and both needs --device cuda" "$tmp/out" ||
    fail "--dtype bf16 on the CPU: $(head -c 300 "$tmp/out")"

# the tiny model at tp 1, 2, 3, 4: 3 does not divide its 4 heads
"$bench" --config tiny -b 2 -s 16 --tp 1,2,3,4 -r 1 -w 0 --csv "$tmp/r.csv" >"$tmp/out" 2>&1 ||
    fail "a tiny run exits $?: $(cat "$tmp/out")"
grep -q "^# tp 3 skipped" "$tmp/out" || fail "tp 3 not reported as skipped"
awk '
    $1 ~ /^[124]$/ && ($3 == "fwd" || $3 == "fwd+bwd") {
        rows++
        if (!($4 > 0)) { print "FAIL: row tp " $1 " " $3 ": time " $4; bad++ }
    }
    END {
        if (rows != 6) { print "FAIL: " rows + 0 " rows, want 6 (tp 1, 2, 4 x fwd, fwd+bwd)"; bad++ }
        exit bad > 0
    }' "$tmp/out" || fails=$((fails + 1))
[ "$(wc -l <"$tmp/r.csv")" -eq 7 ] || fail "the CSV has $(wc -l <"$tmp/r.csv") lines, want 7"
head -n 1 "$tmp/r.csv" | grep -q "^impl,model,params,batch,seq,tp,threads,pass,time_ms," ||
    fail "CSV header: $(head -n 1 "$tmp/r.csv")"
grep -q "^libtp,tiny,.*,2,16,4,1,fwd+bwd," "$tmp/r.csv" || fail "no tp 4 fwd+bwd row in the CSV"

# the config round trip, then a model built from the file
"$bench" --dump-config "$tmp/cfg.json" --config tiny || fail "--dump-config exits $?"
grep -q '"hidden_size": *64' "$tmp/cfg.json" || fail "the dumped config: $(head -c 300 "$tmp/cfg.json")"
"$bench" --config "$tmp/cfg.json" -b 1 -s 8 --tp 2 -p fwd -r 1 -w 0 >"$tmp/out" 2>&1 ||
    fail "a run from the dumped config exits $?: $(cat "$tmp/out")"

# the Llama-3-8B-shaped presets: one layer, and 8 for decode
"$bench" --dump-config "$tmp/8b.json" --config 8b-layer || fail "--dump-config 8b-layer exits $?"
for kv in '"hidden_size": *4096' '"intermediate_size": *14336' '"num_hidden_layers": *1,' \
          '"num_attention_heads": *32' '"num_key_value_heads": *8' '"head_dim": *128' \
          '"vocab_size": *1024' '"rope_theta": *500000' '"max_position_embeddings": *8192' \
          '"tie_word_embeddings": *false' '"hidden_act": *"silu"' '"rms_norm_eps": *1[.0-9]*e-0*5'; do
    grep -q "$kv" "$tmp/8b.json" || fail "8b-layer: no $kv in $(cat "$tmp/8b.json")"
done
"$bench" --dump-config "$tmp/8bs.json" --config 8b-stack || fail "--dump-config 8b-stack exits $?"
grep -q '"num_hidden_layers": *8,' "$tmp/8bs.json" || fail "8b-stack: $(cat "$tmp/8bs.json")"
[ "$(grep -v num_hidden_layers "$tmp/8b.json")" = "$(grep -v num_hidden_layers "$tmp/8bs.json")" ] ||
    fail "8b-layer and 8b-stack differ in more than the layers"

# the passes on CUDA: a small model with grouped kv heads of dim 64
cat >"$tmp/gqa.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 256,
 "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
 "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": false,
 "hidden_act": "silu"}
EOF
"$bench" --config "$tmp/gqa.json" -p fwd+bwd --device cuda --dtype bf16 -b 2 -s 64 --tp 1,2 \
    -r 2 -w 1 --csv "$tmp/cuda.csv" >"$tmp/out" 2>&1
rc=$?
if grep -q "no CUDA device" "$tmp/out"; then
    [ $rc -eq 1 ] || fail "--device cuda without a device exits $rc, not 1"
    grep -qx "tp-bench-llm: --device cuda: no CUDA device" "$tmp/out" ||
        fail "--device cuda without a device: $(head -c 300 "$tmp/out")"
    [ ! -s "$tmp/cuda.csv" ] || fail "--device cuda without a device wrote a CSV"
else
    [ $rc -eq 0 ] || fail "--device cuda exits $rc: $(tail -c 2000 "$tmp/out")"
    # the by-hand table: per tp a fwd+bwd row with a positive model, GEMMs and
    # attention time, and the ratio against the 0.85 target
    awk '
        $1 ~ /^[12]$/ && $3 == "fwd+bwd" && $(NF - 1) == "0.85:" {
            rows++
            if (!($4 > 0) || !($5 > 0) || !($7 > 0) || !($9 > 0)) { print "FAIL: by hand: " $0; bad++ }
        }
        END { if (rows != 2) { print "FAIL: " rows + 0 " by-hand rows, want 2"; bad++ } exit bad > 0 }' \
        "$tmp/out" || { fails=$((fails + 1)); cat "$tmp/out"; }
    head -n 1 "$tmp/cuda.csv" | grep -q ",cpu_ms,device,dtype,gemm_ms,attn_ms,hand_over_model," ||
        fail "CUDA CSV header: $(head -n 1 "$tmp/cuda.csv")"
    grep -q "^libtp,.*,2,64,2,1,fwd+bwd,.*,cuda,bf16," "$tmp/cuda.csv" ||
        fail "no tp 2 cuda bf16 row in the CSV: $(cat "$tmp/cuda.csv")"
fi

# --save in shards, then --load without dropping the machine's caches
"$bench" --save "$tmp/ckpt" --config tiny --max-shard-bytes 100000 >"$tmp/out" 2>&1 ||
    fail "--save exits $?: $(cat "$tmp/out")"
[ "$(ls "$tmp/ckpt"/*.safetensors 2>/dev/null | wc -l)" -gt 1 ] || fail "--save wrote no shards: $(ls "$tmp/ckpt")"
[ -f "$tmp/ckpt/model.safetensors.index.json" ] || fail "--save wrote no index"
# the checkpoint's weights under --model, at tp 1 and 2
"$bench" --model "$tmp/ckpt" -b 1 -s 8 --tp 1,2 -p fwd+bwd -r 1 -w 0 >"$tmp/out" 2>&1 ||
    fail "--model exits $?: $(cat "$tmp/out")"
[ "$(grep -c '^  [12] .* fwd+bwd ' "$tmp/out")" -eq 2 ] || fail "--model: not two fwd+bwd rows: $(cat "$tmp/out")"
"$bench" --load "$tmp/ckpt" --tp 2 -r 1 --no-drop >"$tmp/out" 2>&1 || fail "--load exits $?: $(cat "$tmp/out")"
grep -q "^  cold " "$tmp/out" || fail "--load: no cold row: $(cat "$tmp/out")"
grep -q "^  warm " "$tmp/out" || fail "--load: no warm row"
awk '$1 == "all" { n++; if (!($4 > 0) || !($6 >= 1)) { print "FAIL: memory row: " $0; bad++ } }
     END { if (n != 1) { print "FAIL: " n + 0 " memory rows, want 1"; bad++ } exit bad > 0 }' "$tmp/out" ||
    fails=$((fails + 1))

if [ $fails -ne 0 ]; then
    cat "$tmp/out"
    exit 1
fi
echo "tp-bench-llm CLI: ok"
