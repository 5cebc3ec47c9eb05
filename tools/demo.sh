#!/bin/sh
# make demo: the future pipeline end to end (devpickle demo), then pack every
# example value, verify the frame, dump its pointers and check that unpack
# gives back JSON that packs to the same bytes. Stops at the first failure.
set -eu
cli=${1:-build/devpickle}
echo "== devpickle demo"
"$cli" demo
echo
# The frames go beside the CLI: `make demo BUILD=DIR` writes under DIR, not ./build.
out=$(dirname "$cli")/examples
mkdir -p "$out"
for json in examples/*.json; do
  name=$(basename "$json" .json)
  frame="$out/$name.dpk"
  echo "== $json"
  "$cli" pack "$json" -o "$frame"
  "$cli" verify "$frame"
  "$cli" dump "$frame"
  "$cli" unpack "$frame" > "$out/$name.unpacked.json"
  "$cli" pack "$out/$name.unpacked.json" -o "$out/$name.again.dpk"
  cmp "$frame" "$out/$name.again.dpk"
  echo "unpack -> pack: identical bytes"
  echo
done
