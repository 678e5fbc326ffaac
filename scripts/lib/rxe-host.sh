# rxe-host.sh -- host-side helpers (bash) for the scripts that run the rxe
# VM (rxe-test.sh, rxe-lat-ab.sh, rxe-size-sweep.sh): sourced with ROOT set
# to the repository's root.

# rxe_vm_script: prints the VM runner's path (RXE_VM_SCRIPT overrides; it
# may not exist: the caller reports the run skipped then).
rxe_vm_script() {
    local vm=${RXE_VM_SCRIPT:-$ROOT/../shared/tools/rxe-vm/run-in-rxe-vm.sh}
    [ -x "$vm" ] || vm=/work/shared/tools/rxe-vm/run-in-rxe-vm.sh
    echo "$vm"
}

# rxe_guest_binary WHO BINARY: exits 2 (WHO names the script in the
# message) unless BINARY is an executable under ROOT, the only tree the
# guest sees.
rxe_guest_binary() {
    case $(realpath -m "$2") in
        "$ROOT"/*) [ -x "$2" ] || { echo "$1: $2 is not executable" >&2; exit 2; } ;;
        *) echo "$1: $2 must be under $ROOT (the guest sees only it)" >&2; exit 2 ;;
    esac
}
