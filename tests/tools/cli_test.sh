#!/usr/bin/env bash
# End-to-end tests of the `bie` command.
#   cli_test.sh usage BIE   bad commands and options are rejected cleanly (no data needed)
#   cli_test.sh train BIE   short training runs on a subset of Fashion-MNIST: the loss falls,
#                           accuracy beats chance by far, the same seed reproduces the run bit
#                           for bit, export -> eval gives the same predictions, bad model files
#                           are rejected. Exit 77 (skipped) without the data set.
set -uo pipefail
mode=$1
bie=$2
work=$(mktemp -d /tmp/bie_cli_test.XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAILED: $*" >&2; }

# expect STATUS FRAGMENT CMD...: exit status STATUS and FRAGMENT in stdout+stderr.
expect() {
  local want=$1 fragment=$2
  shift 2
  local out status
  out=$("$@" 2>&1)
  status=$?
  if [[ $status -ne $want ]]; then
    bad "$* exited $status, expected $want: $out"
  elif [[ $out != *"$fragment"* ]]; then
    bad "$* printed no '$fragment': $out"
  else
    ok
  fi
}

finish() {
  echo "$passed passed, $failed failed"
  [[ $failed -eq 0 ]]
  exit $?
}

if [[ $mode == usage ]]; then
  expect 0 "usage: bie COMMAND" "$bie" --help
  expect 0 "bie 0." "$bie" --version
  expect 2 "usage: bie COMMAND" "$bie"
  expect 2 "unknown command 'frobnicate'" "$bie" frobnicate
  expect 0 "--epochs N" "$bie" train --help
  expect 0 "usage: bie export" "$bie" export --help
  expect 0 "--images FILE" "$bie" predict --help
  expect 0 "--logits" "$bie" predict --help
  expect 2 "did you mean --epochs" "$bie" train --epoch 3
  expect 2 "expects an integer" "$bie" train --epochs three
  expect 2 "out of range" "$bie" train --threads -3
  expect 2 "must be one of mlp|cnn|resnet" "$bie" train --model vgg
  expect 2 "--depth applies to the resnet preset only" "$bie" train --model cnn --depth 3
  expect 2 "must be at least 2" "$bie" train --batch-size 1
  expect 2 "needs a value" "$bie" train --lr
  expect 2 "must be positive" "$bie" train --lr 0
  expect 2 "unexpected argument" "$bie" train extra
  expect 0 "--augment none|shift|flip|shift-flip" "$bie" train --help
  expect 2 "must be one of none|shift|flip|shift-flip" "$bie" train --augment rotate
  expect 2 "out of range" "$bie" train --augment shift --augment-shift 9
  expect 2 "out of range" "$bie" train --augment-shift 0
  if ! command -v nvidia-smi >/dev/null 2>&1; then # without a GPU, --device cuda is refused
    expect 1 "; use --device cpu" "$bie" train --device cuda
    expect 1 "; use --device cpu" "$bie" eval x.safetensors --device cuda
  fi
  expect 2 "missing MODEL" "$bie" eval
  expect 2 "missing MODEL" "$bie" export
  expect 1 "cannot open" "$bie" eval "$work/none.safetensors"
  expect 1 "apt-get install dataset-fashion-mnist" "$bie" train --data "$work" --out "$work/o"
  # files that are not model files
  printf 'hello' >"$work/short.safetensors"
  expect 1 "truncated" "$bie" eval "$work/short.safetensors"
  head -c 4096 /dev/urandom >"$work/random.safetensors"
  expect 1 "random.safetensors" "$bie" predict "$work/random.safetensors"
  printf '\x02\x00\x00\x00\x00\x00\x00\x00{}' >"$work/empty.safetensors"
  expect 1 "not a bie model file" "$bie" eval "$work/empty.safetensors"
  finish
fi

data=${BIE_DATA_DIR:-/usr/share/datasets/fashion-mnist}
if [[ ! -e $data/train-images-idx3-ubyte.gz && ! -e $data/train-images-idx3-ubyte ]]; then
  echo "skipped: Fashion-MNIST not installed in $data (apt-get install dataset-fashion-mnist)"
  exit 77
fi

# A few hundred steps of the MLP on a subset: 3 epochs x 93 steps.
train=("$bie" train --model mlp --width 128 --epochs 3 --batch-size 32 --train-limit 3000
       --test-limit 1000 --threads 2 --seed 5 --progress plain)
"${train[@]}" --out "$work/a" >"$work/a.log" 2>&1 || bad "training failed: $(cat "$work/a.log")"
if [[ -f $work/a/metrics.csv ]]; then
  ok
  # The loss falls from epoch to epoch; test accuracy is far above chance (10 %).
  awk -F, 'NR == 2 {first = $2} NR == 4 {last = $2; acc = $4}
           END {exit !(NR == 4 && last < first && acc > 0.6)}' "$work/a/metrics.csv" \
    && ok || bad "loss did not fall or accuracy too low: $(cat "$work/a/metrics.csv")"
  grep -q "</svg>" "$work/a/training_curve.svg" && ok || bad "no SVG curve"
  grep -q "samples/s" "$work/a.log" && grep -q "ETA" "$work/a.log" && ok || bad "no progress lines"
else
  bad "no metrics.csv"
fi

# The same seed and thread count reproduce the run bit for bit; another seed does not.
"${train[@]}" --out "$work/b" >/dev/null 2>&1
cmp -s "$work/a/metrics.csv" "$work/b/metrics.csv" && ok || bad "same seed, different metrics"
cmp -s "$work/a/model.safetensors" "$work/b/model.safetensors" && ok || bad "same seed, different model"
"${train[@]}" --seed 6 --epochs 1 --out "$work/c" >/dev/null 2>&1
a1=$(sed -n 2p "$work/a/metrics.csv")
c1=$(sed -n 2p "$work/c/metrics.csv")
[[ -n $c1 && $a1 != "$c1" ]] && ok || bad "another seed gave the same first epoch"

# export -> the packed model predicts exactly what the trained model predicts.
expect 0 "smaller than float32" "$bie" export "$work/a/model.safetensors" "$work/packed.safetensors"
ratio=$("$bie" export "$work/a/model.safetensors" "$work/packed2.safetensors" |
        sed -n 's/.*packed: \([0-9.]*\)x smaller.*/\1/p')
awk -v r="$ratio" 'BEGIN {exit !(r >= 25)}' && ok || bad "binary layers only ${ratio}x smaller"
expect 1 "already packed" "$bie" export "$work/packed.safetensors" "$work/again.safetensors"
p1=$("$bie" predict "$work/a/model.safetensors" --count 300 --data "$data")
p2=$("$bie" predict "$work/packed.safetensors" --count 300 --data "$data")
[[ -n $p1 && $p1 == "$p2" ]] && ok || bad "packed predictions differ"
e1=$("$bie" eval "$work/a/model.safetensors" --limit 1000 | grep "test accuracy" | cut -d, -f1-2)
e2=$("$bie" eval "$work/packed.safetensors" --limit 1000 | grep "test accuracy" | cut -d, -f1-2)
[[ -n $e1 && $e1 == "$e2" ]] && ok || bad "eval differs: '$e1' vs '$e2'"
# The accuracy eval reports is the one training reported for the same test images.
final=$(awk -F, 'END {printf "%.2f%%", 100 * $4}' "$work/a/metrics.csv")
[[ $e1 == *"$final"* ]] && ok || bad "eval '$e1' is not the training's $final"

# The CNN preset end to end (tiny: width 4, one epoch of 640 images).
"$bie" train --model cnn --width 4 --epochs 1 --train-limit 640 --test-limit 200 --threads 2 \
  --progress none --out "$work/cnn" >"$work/cnn.log" 2>&1 && ok || bad "cnn: $(cat "$work/cnn.log")"
expect 0 "smaller than float32" "$bie" export "$work/cnn/model.safetensors" "$work/cnnp.safetensors"
q1=$("$bie" predict "$work/cnn/model.safetensors" --first 17 --count 50)
q2=$("$bie" predict "$work/cnnp.safetensors" --first 17 --count 50)
[[ -n $q1 && $q1 == "$q2" && $q1 == *"test[17]"* ]] && ok || bad "cnn packed predictions differ"

# The residual preset end to end (tiny: width 4, depth 1, two epochs of 1,000 images): the
# training loss falls, the packed export predicts what the trained model does.
"$bie" train --model resnet --width 4 --depth 1 --epochs 2 --train-limit 1000 --test-limit 200 \
  --threads 2 --progress none --out "$work/rn" >"$work/rn.log" 2>&1 && ok || bad "resnet: $(cat "$work/rn.log")"
awk -F, 'NR == 2 {a = $2} END {exit !($2 < a)}' "$work/rn/metrics.csv" && ok ||
  bad "resnet: the training loss did not fall: $(cat "$work/rn/metrics.csv")"
expect 0 "smaller than float32" "$bie" export "$work/rn/model.safetensors" "$work/rnp.safetensors"
r1=$("$bie" predict "$work/rn/model.safetensors" --first 5 --count 40)
r2=$("$bie" predict "$work/rnp.safetensors" --first 5 --count 40)
[[ -n $r1 && $r1 == "$r2" ]] && ok || bad "resnet packed predictions differ"
# --logits: one line of 10 scores per image, the same bit for bit from the packed model.
l1=$("$bie" predict "$work/rn/model.safetensors" --first 5 --count 40 --logits)
l2=$("$bie" predict "$work/rnp.safetensors" --first 5 --count 40 --logits)
[[ -n $l1 && $l1 == "$l2" ]] && ok || bad "resnet packed logits differ"
awk 'NF != 11 || $1 !~ /^test\[[0-9]+\]:$/ {exit 1} END {exit NR != 40}' <<<"$l1" && ok ||
  bad "--logits: not 40 lines of 10 scores: $l1"

# Augmentation: the same seed reproduces an augmented run bit for bit; it is not the plain run.
cnn_aug=("$bie" train --model cnn --width 4 --epochs 2 --train-limit 640 --test-limit 200
         --threads 2 --progress none --augment shift-flip --augment-shift 3)
"${cnn_aug[@]}" --out "$work/aug1" >"$work/aug1.log" 2>&1 && ok || bad "augment: $(cat "$work/aug1.log")"
grep -q "augmentation of the training images: shift 3 + flip" "$work/aug1.log" && ok ||
  bad "augmentation not reported: $(cat "$work/aug1.log")"
"${cnn_aug[@]}" --out "$work/aug2" >/dev/null 2>&1
cmp -s "$work/aug1/model.safetensors" "$work/aug2/model.safetensors" && ok || bad "augmented run not reproduced"
"${cnn_aug[@]}" --augment none --out "$work/aug3" >/dev/null 2>&1
[[ -f $work/aug3/metrics.csv ]] && ! cmp -s "$work/aug1/metrics.csv" "$work/aug3/metrics.csv" && ok ||
  bad "augmentation changed nothing"

# Broken model files are rejected with a reason, never a crash.
size=$(stat -c %s "$work/packed.safetensors")
head -c $((size - 5)) "$work/packed.safetensors" >"$work/cut.safetensors"
expect 1 "past the end of the data" "$bie" eval "$work/cut.safetensors" --limit 10
head -c 100 "$work/packed.safetensors" >"$work/cut2.safetensors"
expect 1 "truncated" "$bie" eval "$work/cut2.safetensors" --limit 10
sed 's/"dtype":"F32"/"dtype":"F64"/' "$work/packed.safetensors" >"$work/dtype.safetensors"
expect 1 "needs" "$bie" eval "$work/dtype.safetensors" --limit 10
sed 's/"packed":"true"/"packed":"TRUE"/' "$work/packed.safetensors" >"$work/meta.safetensors"
expect 1 "'packed' must be" "$bie" eval "$work/meta.safetensors" --limit 10
finish
