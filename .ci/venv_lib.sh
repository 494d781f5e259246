# Shared by the scripts that build the side venvs (scripts/{debug_gym,sglang,vllm}/
# setup_env.sh). Source it after setting `root`, `venv` and defining `say`.

# find_python VERSION OVERRIDE: OVERRIDE if set, else pyenv's VERSION, else pythonVERSION.
find_python() {
  local version=$1 override=${2:-} pyroot candidate
  if [[ -n $override ]]; then echo "$override"; return; fi
  pyroot=$( (command -v pyenv >/dev/null && pyenv root) || echo "$HOME/.pyenv")
  for candidate in "$pyroot"/versions/"$version"*/bin/python"$version"; do
    [[ -x $candidate ]] && { echo "$candidate"; return; }
  done
  command -v "python$version" || { echo "no Python $version found" >&2; exit 1; }
}

# make_venv VERSION OVERRIDE: create $venv unless it exists; sets `pip` and `log`.
make_venv() {
  if [[ ! -x $venv/bin/python ]]; then
    local py
    py=$(find_python "$1" "${2:-}")
    say "creating $venv with $py"
    "$py" -m venv "$venv"
  else
    say "reusing $venv ($("$venv/bin/python" --version))"
  fi
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  log=$venv/pip-install.log
}

# pip_install ARGS...: pip's output goes to $log (the resolver's complaints about packages
# installed with --no-deps are expected there); on failure its tail is shown.
pip_install() {
  if ! "${pip[@]}" install "$@" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "pip install failed; full log: $log" >&2
    exit 1
  fi
}

# pins_installed PIN...: true when $venv was last built from these pins and this
# pyproject.toml (a stamp of both; a change to either reinstalls). Call pins_stamped after.
pins_installed() {
  stamp=$venv/.leyline-setup-stamp
  want=$( { printf '%s\n' "$@"; cat "$root/pyproject.toml"; } | sha256sum | cut -d' ' -f1)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    say "packages already installed (the stamp matches the pins and pyproject.toml)"
    return 0
  fi
  rm -f "$stamp"
  : >"$log"
  return 1
}

# pins_stamped: record that the pins pins_installed was given are now installed.
pins_stamped() {
  echo "$want" >"$stamp"
}
