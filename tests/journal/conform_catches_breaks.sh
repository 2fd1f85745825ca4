#!/bin/sh
# Proves `flatc --conform` rejects breaking edits of the released schema (so the CI gate can fail):
# a removed field, reordered union members, a changed field type. A gate that passes these
# would let an incompatible events.fbs ship.
# usage: conform_catches_breaks.sh FLATC RELEASED_SCHEMA WORKDIR
set -u
flatc=$1 released=$2 work=$3
mkdir -p "$work"
fail=0
check_breaks() {  # name, sed expression
  sed "$2" "$released" > "$work/$1.fbs"
  if cmp -s "$released" "$work/$1.fbs"; then echo "edit '$1' changed nothing"; fail=1; return; fi
  if out=$("$flatc" --conform "$released" "$work/$1.fbs" 2>&1); then
    echo "conform accepted breaking change '$1'"; fail=1
  else
    case "$out" in
      *"don't conform"*) echo "ok: '$1' rejected: $(echo "$out" | grep conform)" ;;
      *) echo "'$1' failed for another reason: $out"; fail=1 ;;
    esac
  fi
}
check_breaks removed_field '/^  outcome:RolloutOutcome (id: 1);$/d; s/^  prompt_tokens:uint (id: 2);/  prompt_tokens:uint (id: 1);/; s/^  completion_tokens:uint (id: 3);/  completion_tokens:uint (id: 2);/'
check_breaks reordered_union 's/^  BootstrapRequested, UpdateRequested,/  UpdateRequested, BootstrapRequested,/'
check_breaks changed_type 's/^  seq:ulong (id: 0);/  seq:uint (id: 0);/'
# A compatible change (appended field) must still conform.
sed 's/^  reason:string (id: 2);$/  reason:string (id: 2);\n  extra:uint (id: 3);/' "$released" > "$work/appended.fbs"
if ! "$flatc" --conform "$released" "$work/appended.fbs"; then echo "appended field refused"; fail=1; fi
exit $fail
