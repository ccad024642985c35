package main

import (
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
)

// servePprof serves Go's profiles on a loopback port when KUBE_PEERS_PPROF_DIR
// names a folder, and writes the address to <folder>/<subcommand>.addr, so a
// bench can profile the scheduler or the control plane in the middle of a
// burst (`go tool pprof http://ADDR/debug/pprof/profile?seconds=20`).
// Without the variable nothing listens.
func servePprof(subcommand string) error {
	dir := os.Getenv("KUBE_PEERS_PPROF_DIR")
	if dir == "" {
		return nil
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("pprof listener: %w", err)
	}
	addr := filepath.Join(dir, subcommand+".addr")
	if err := os.WriteFile(addr, []byte(listener.Addr().String()), 0o644); err != nil {
		return fmt.Errorf("pprof address: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	go func() { _ = http.Serve(listener, mux) }()
	return nil
}
