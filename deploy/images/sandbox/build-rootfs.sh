#!/usr/bin/env bash
# The sandbox image's base root filesystem, made without a registry: a minimal Debian
# (debootstrap minbase) with Python 3 and the CA certificates, without apt caches or
# documentation, written as a tar archive.
#
# Usage: build-rootfs.sh [OUTPUT.tar | -]     ("-" or nothing: the archive goes to stdout)
# Needs root and debootstrap. The mirror is the one this machine's apt sources use for the
# suite, else deb.debian.org; DEBIAN_MIRROR overrides it. Progress goes to stderr.
set -euo pipefail

suite=bookworm
# python3, not python3-minimal: the runner needs json, http.client, dataclasses and asyncio,
# which Debian ships in libpython3.11-stdlib. ca-certificates: https control URLs.
packages=python3,ca-certificates
output=${1:--}

die() { echo "build-rootfs.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap creates device nodes and chroots)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
if [ "$output" = - ] && [ -t 1 ]; then
  die "refusing to write a tar archive to a terminal; give an output path"
fi

# The first URI this machine's apt uses for the suite: one-line sources (deb [opts] URI
# SUITE ...) and deb822 stanzas (Types/URIs/Suites).
apt_mirror() {
  local one_line=() deb822=()
  [ -f /etc/apt/sources.list ] && one_line+=(/etc/apt/sources.list)
  for file in /etc/apt/sources.list.d/*.list; do [ -f "$file" ] && one_line+=("$file"); done
  for file in /etc/apt/sources.list.d/*.sources; do [ -f "$file" ] && deb822+=("$file"); done
  if [ ${#one_line[@]} -gt 0 ]; then
    awk -v suite="$suite" '
      $1 == "deb" { sub(/\[[^]]*\]/, ""); if ($3 == suite) { print $2; exit } }
    ' "${one_line[@]}"
  fi
  if [ ${#deb822[@]} -gt 0 ]; then
    awk -v suite="$suite" '
      BEGIN { RS = "" }
      {
        types = ""; uris = ""; suites = ""; enabled = "yes"
        count = split($0, lines, "\n")
        for (i = 1; i <= count; i++) {
          if (lines[i] ~ /^#/ || !match(lines[i], /^[A-Za-z-]+:/)) continue
          key = tolower(substr(lines[i], 1, RLENGTH - 1)); value = substr(lines[i], RLENGTH + 1)
          if (key == "types") types = value
          else if (key == "uris") uris = value
          else if (key == "suites") suites = value
          else if (key == "enabled") enabled = value
        }
        if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled !~ /no/ &&
            (" " suites " ") ~ ("[ \t]" suite "[ \t]")) {
          split(uris, first, " "); print first[1]; exit
        }
      }
    ' "${deb822[@]}"
  fi
}

mirror=${DEBIAN_MIRROR:-$(apt_mirror | head -n 1)}
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d "${TMPDIR:-/tmp}/corral-rootfs.XXXXXX")
root=$work/root
cleanup() {
  # debootstrap mounts /proc and /sys in the target; a killed run can leave them mounted,
  # and rm must not descend into them.
  awk -v prefix="$root/" 'index($5, prefix) == 1 { print $5 }' /proc/self/mountinfo \
    | sort -r | while read -r mountpoint; do umount -l "$mountpoint" || true; done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

echo "build-rootfs.sh: debootstrap $suite from $mirror with $packages" >&2
debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >&2

# Smaller, and it stays small: what later apt runs in the image would add is excluded too.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
  "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/var/cache/debconf/*-old \
  "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
  "$root"/usr/share/lintian "$root"/usr/share/linda
# Licences stay: the copyright files are all that is kept of /usr/share/doc.
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
cat >"$root/etc/dpkg/dpkg.cfg.d/corral-nodoc" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CFG
cat >"$root/etc/apt/apt.conf.d/corral-clean" <<'CFG'
APT::Keep-Downloaded-Packages "false";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CFG
# The engine provides these per container; the build machine's must not leak into the image.
rm -f "$root/etc/resolv.conf" "$root/etc/hostname"

# Device nodes and kernel file systems are the engine's to provide.
archive() {
  tar --numeric-owner --one-file-system -C "$root" \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf - .
}
if [ "$output" = - ]; then
  archive
else
  archive >"$output.partial"
  mv "$output.partial" "$output"
fi
