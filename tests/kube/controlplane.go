package main

// The control plane: etcd embedded in this process, kube-apiserver and
// kube-controller-manager as children (this binary's upstream subcommands),
// each restarted when it exits, as a kubelet restarts static pods. A test
// restarts the API server by killing the pid in <dir>/kube-apiserver.pid;
// etcd and the port stay, as on a real control-plane node.

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"
)

func runControlPlane(args []string) error {
	fs := flag.NewFlagSet("controlplane", flag.ContinueOnError)
	dir := fs.String("dir", "", "state directory (etcd data, certificates, kubeconfigs, logs)")
	// The controllers the tests need: service-account tokens, a pod's
	// ResourceClaims made from its templates, owned objects collected,
	// namespaces, the nodes' not-ready taint; and the deployment and
	// replicaset controllers, so a Deployment whose pods take their claims
	// from a ResourceClaimTemplate runs as on a cluster.
	controllers := fs.String("controllers", "serviceaccount-controller,resourceclaim-controller,garbage-collector-controller,namespace-controller,node-lifecycle-controller,deployment-controller,replicaset-controller", "kube-controller-manager --controllers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" {
		return fmt.Errorf("controlplane: --dir is required")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = exitWithParent(ctx)

	files, err := writeControlPlaneFiles(*dir)
	if err != nil {
		return err
	}
	etcd, etcdURL, err := startEtcd(filepath.Join(*dir, "etcd"))
	if err != nil {
		return err
	}
	defer etcd.Close()

	var wg sync.WaitGroup
	supervise(ctx, &wg, *dir, "kube-apiserver", []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(files.port),
		"--tls-cert-file=" + files.servingCert,
		"--tls-private-key-file=" + files.servingKey,
		"--token-auth-file=" + files.tokens,
		"--client-ca-file=" + files.clientCA,
		// A kubelet's own limits: kubelet peers run as system:node:<name>.
		"--enable-admission-plugins=NodeRestriction",
		"--authorization-mode=Node,RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + files.saKey,
		"--service-account-signing-key-file=" + files.saKey,
		"--service-cluster-ip-range=10.96.0.0/16",
		// No Service traffic is ever routed here: the endpoints of the
		// `kubernetes` Service would name a loopback address.
		"--endpoint-reconciler-type=none",
		"--allow-privileged=true",
		"--profiling=false",
		// DRA needs no flag here, nor in the controller manager, the
		// scheduler or the kubelet peer: in v1.37 resource.k8s.io/v1 is
		// served by default, and pkg/features has every gate the tests use
		// on by default: DynamicResourceAllocation and DRAPrioritizedList
		// GA (locked on), DRAConsumableCapacity, DRAExtendedResource,
		// DRADeviceTaints, DRAPartitionableDevices and ResourceHealthStatus
		// beta since 1.36, on. DRADeviceTaintRules (the DeviceTaintRule
		// API) is alpha and stays off.
	})
	if err := waitReady(ctx, files); err != nil {
		return err
	}
	cmArgs := []string{
		"--kubeconfig=" + files.adminKubeconfig,
		"--controllers=" + *controllers,
		"--leader-elect=false",
		"--secure-port=0",
		"--use-service-account-credentials=false",
	}
	// A bench knob: the controller manager's client rate (upstream's
	// default, 20 requests/s with bursts of 30, when unset), which paces
	// the ResourceClaims it makes from templates.
	if qps := os.Getenv("KUBE_CONTROLLER_MANAGER_QPS"); qps != "" {
		n, err := strconv.Atoi(qps)
		if err != nil || n <= 0 {
			return fmt.Errorf("KUBE_CONTROLLER_MANAGER_QPS: a positive count of requests per second, not %q", qps)
		}
		cmArgs = append(cmArgs, "--kube-api-qps="+qps, "--kube-api-burst="+strconv.Itoa(2*n))
	}
	supervise(ctx, &wg, *dir, "kube-controller-manager", cmArgs)
	if err := os.WriteFile(filepath.Join(*dir, "ready"), []byte(files.server+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Println("control plane ready at", files.server)
	<-ctx.Done()
	wg.Wait()
	return nil
}

type controlPlaneFiles struct {
	port                                       int
	server                                     string
	servingCert, servingKey, saKey, tokens, ca string
	clientCA                                   string
	adminKubeconfig, adminToken                string
}

// writeControlPlaneFiles makes the serving certificate, the service-account
// signing key, the static admin token and the admin kubeconfig.
func writeControlPlaneFiles(dir string) (controlPlaneFiles, error) {
	f := controlPlaneFiles{
		servingCert:     filepath.Join(dir, "serving.crt"),
		servingKey:      filepath.Join(dir, "serving.key"),
		saKey:           filepath.Join(dir, "sa.key"),
		tokens:          filepath.Join(dir, "tokens.csv"),
		adminKubeconfig: filepath.Join(dir, "admin.kubeconfig"),
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return f, err
	}
	port, err := freePort()
	if err != nil {
		return f, err
	}
	f.port = port
	f.server = "https://127.0.0.1:" + strconv.Itoa(port)
	// The bundle holds the serving certificate and the CA that signed it;
	// clients trust the bundle.
	cert, key, err := certutil.GenerateSelfSignedCertKey("127.0.0.1", []net.IP{net.ParseIP("127.0.0.1")}, []string{"localhost"})
	if err != nil {
		return f, err
	}
	f.ca = f.servingCert
	saKey, err := keyutil.MakeEllipticPrivateKeyPEM()
	if err != nil {
		return f, err
	}
	if f.clientCA, err = writeClientCA(dir); err != nil {
		return f, err
	}
	f.adminToken = randomToken()
	for path, data := range map[string][]byte{
		f.servingCert: cert,
		f.servingKey:  key,
		f.saKey:       saKey,
		f.tokens:      []byte(f.adminToken + ",admin,admin-uid,system:masters\n"),
	} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return f, err
		}
	}
	return f, writeKubeconfig(f.adminKubeconfig, &clientcmdapi.Cluster{Server: f.server, CertificateAuthorityData: cert},
		&clientcmdapi.AuthInfo{Token: f.adminToken})
}

func randomToken() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startEtcd starts etcd on two free ports. A port found free may be taken
// by another process before etcd binds it (tests start control planes side
// by side): then it tries other ports, a few times.
func startEtcd(dir string) (*embed.Etcd, string, error) {
	for attempt := 1; ; attempt++ {
		e, url, err := startEtcdOnce(dir)
		taken := err != nil && (errors.Is(err, syscall.EADDRINUSE) ||
			strings.Contains(err.Error(), "address already in use"))
		if !taken || attempt == 5 {
			return e, url, err
		}
	}
}

func startEtcdOnce(dir string) (*embed.Etcd, string, error) {
	cfg := embed.NewConfig()
	cfg.Dir = dir
	cfg.LogLevel = "error"
	clientPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	client, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(clientPort))
	peer, _ := url.Parse("http://127.0.0.1:" + strconv.Itoa(peerPort))
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*client}, []url.URL{*client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*peer}, []url.URL{*peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, "", fmt.Errorf("etcd not ready within 60s")
	}
	return e, client.String(), nil
}

// supervise runs this binary's subcommand `name` with args until ctx ends,
// restarting it a second after each exit. Its pid is in <dir>/<name>.pid,
// its output appended to <dir>/<name>.log.
func supervise(ctx context.Context, wg *sync.WaitGroup, dir, name string, args []string) {
	self, _ := os.Executable()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			log, err := os.OpenFile(filepath.Join(dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
			if err != nil {
				fmt.Fprintln(os.Stderr, "controlplane:", err)
				return
			}
			cmd := exec.Command(self, append([]string{name}, args...)...)
			cmd.Stdout, cmd.Stderr = log, log
			if err := cmd.Start(); err != nil {
				fmt.Fprintln(os.Stderr, "controlplane: start", name, err)
			} else {
				_ = os.WriteFile(filepath.Join(dir, name+".pid"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644)
				done := make(chan struct{})
				go func() {
					select {
					case <-ctx.Done():
						_ = cmd.Process.Signal(syscall.SIGTERM)
					case <-done:
					}
				}()
				_ = cmd.Wait()
				close(done)
			}
			log.Close()
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}()
}

// waitReady polls /readyz as the admin until it answers 200.
func waitReady(ctx context.Context, f controlPlaneFiles) error {
	client := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}},
	}
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, f.server+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+f.adminToken)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return fmt.Errorf("kube-apiserver not ready within 3 minutes")
}

// exitWithParent returns a context that ends when this process's parent
// goes (the test binary that started it died without stopping it).
func exitWithParent(ctx context.Context) context.Context {
	parent := os.Getppid()
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		for ctx.Err() == nil {
			if os.Getppid() != parent {
				cancel()
				return
			}
			time.Sleep(500 * time.Millisecond)
		}
	}()
	return ctx
}
