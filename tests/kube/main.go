// Command kube-peers runs unmodified Kubernetes components for the
// product's end-to-end tests: each subcommand is either an upstream command
// as shipped (kube-apiserver, kube-scheduler, kube-controller-manager) or a
// small main of ours around upstream packages (the control plane's
// supervisor, the kubelet's device and DRA managers, apply and token
// helpers, a test-only DRA driver).
// Everything listens on loopback only.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	name, args := os.Args[1], os.Args[2:]
	err := servePprof(name)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kube-peers:", err)
		os.Exit(1)
	}
	switch name {
	case "kube-apiserver":
		err = runUpstream(apiserver.NewAPIServerCommand(), args)
	case "kube-scheduler":
		err = runUpstream(scheduler.NewSchedulerCommand(), args)
	case "kube-controller-manager":
		err = runUpstream(controllermanager.NewControllerManagerCommand(), args)
	case "controlplane":
		err = runControlPlane(args)
	case "kubelet":
		err = runKubelet(args)
	case "apply":
		err = runApply(args)
	case "token":
		err = runToken(args)
	case "node-kubeconfig":
		err = runNodeKubeconfig(args)
	case "dra-test-driver":
		err = runDRATestDriver(args)
	default:
		err = fmt.Errorf("unknown subcommand %q\n%s", name, usage)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kube-peers:", err)
		os.Exit(1)
	}
}

const usage = `usage: kube-peers SUBCOMMAND [flags]
  controlplane            etcd (embedded) + kube-apiserver + kube-controller-manager, supervised
  kube-apiserver          the upstream command, unmodified
  kube-controller-manager the upstream command, unmodified
  kube-scheduler          the upstream command, unmodified
  kubelet                 the kubelet's device manager, DRA manager and admission for one node
  apply                   server-side apply of manifests or a kustomization
  token                   a kubeconfig for a service account, from a TokenRequest
  node-kubeconfig         a kubeconfig for system:node:<name>, signed by the control plane's client CA
  dra-test-driver         a DRA driver for tests only (upstream kubeletplugin helper), logging its calls`

// runUpstream runs an upstream cobra command on args, as its own binary would.
// It ends with its parent process, so no test run leaves one behind.
func runUpstream(cmd *cobra.Command, args []string) error {
	go func() {
		<-exitWithParent(context.Background()).Done()
		os.Exit(0)
	}()
	cmd.SetArgs(args)
	return cmd.Execute()
}
