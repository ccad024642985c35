package main

// apply: server-side apply of manifest files or kustomization directories
// (rendered by kustomize's own library, as `kubectl apply -k` does), and
// token: a kubeconfig for a service account from a TokenRequest, so each
// component runs with its own identity.

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func runApply(args []string) error {
	fs := flag.NewFlagSet("apply", flag.ContinueOnError)
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig of the identity that applies")
	var files, kustomizations stringList
	fs.Var(&files, "f", "a manifest file (repeatable; - reads standard input)")
	fs.Var(&kustomizations, "k", "a kustomization directory (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return err
	}
	var objects []*unstructured.Unstructured
	for _, dir := range kustomizations {
		resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
		if err != nil {
			return fmt.Errorf("kustomize %s: %w", dir, err)
		}
		text, err := resources.AsYaml()
		if err != nil {
			return err
		}
		decoded, err := decodeObjects(bytes.NewReader(text))
		if err != nil {
			return fmt.Errorf("%s: %w", dir, err)
		}
		objects = append(objects, decoded...)
	}
	for _, file := range files {
		var r io.Reader = os.Stdin
		if file != "-" {
			text, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			r = bytes.NewReader(text)
		}
		decoded, err := decodeObjects(r)
		if err != nil {
			return fmt.Errorf("%s: %w", file, err)
		}
		objects = append(objects, decoded...)
	}
	return applyObjects(config, objects)
}

func decodeObjects(r io.Reader) ([]*unstructured.Unstructured, error) {
	decoder := utilyaml.NewYAMLOrJSONDecoder(r, 4096)
	var out []*unstructured.Unstructured
	for {
		obj := &unstructured.Unstructured{}
		if err := decoder.Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
		if len(obj.Object) > 0 {
			out = append(out, obj)
		}
	}
}

// applyObjects applies each object in order, server-side, as field manager
// kube-peers. A kind the API server does not know yet (just registered) is
// retried for a while.
func applyObjects(config *rest.Config, objects []*unstructured.Unstructured) error {
	dyn, err := dynamic.NewForConfig(config)
	if err != nil {
		return err
	}
	disc, err := discovery.NewDiscoveryClientForConfig(config)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))
	ctx := context.Background()
	for _, obj := range objects {
		gvk := obj.GroupVersionKind()
		var lastErr error
		for attempt := 0; attempt < 50; attempt++ {
			if attempt > 0 {
				mapper.Reset()
				time.Sleep(200 * time.Millisecond)
			}
			mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				lastErr = err
				continue
			}
			var client dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
			if mapping.Scope.Name() == "namespace" {
				ns := obj.GetNamespace()
				if ns == "" {
					ns = metav1.NamespaceDefault
				}
				client = dyn.Resource(mapping.Resource).Namespace(ns)
			}
			body, err := obj.MarshalJSON()
			if err != nil {
				return err
			}
			force := true
			_, lastErr = client.Patch(ctx, obj.GetName(), types.ApplyPatchType, body, metav1.PatchOptions{FieldManager: "kube-peers", Force: &force})
			if lastErr == nil {
				break
			}
		}
		if lastErr != nil {
			return fmt.Errorf("apply %s %s/%s: %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), lastErr)
		}
	}
	return nil
}

func runToken(args []string) error {
	fs := flag.NewFlagSet("token", flag.ContinueOnError)
	kubeconfig := fs.String("kubeconfig", "", "the admin kubeconfig (server and CA are copied from it)")
	namespace := fs.String("namespace", "", "the service account's namespace")
	name := fs.String("name", "", "the service account")
	pod := fs.String("pod", "", "bind the token to this pod of the namespace (its node comes with it, as for a DaemonSet's pod)")
	out := fs.String("out", "", "where to write the kubeconfig")
	if err := fs.Parse(args); err != nil {
		return err
	}
	config, client, err := clientFor(*kubeconfig)
	if err != nil {
		return err
	}
	seconds := int64(24 * 3600)
	request := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &seconds}}
	var token *authenticationv1.TokenRequest
	// The service account (or the pod) may have been created a moment ago.
	for attempt := 0; ; attempt++ {
		if *pod != "" {
			var bound *corev1.Pod
			if bound, err = client.CoreV1().Pods(*namespace).Get(context.Background(), *pod, metav1.GetOptions{}); err == nil {
				request.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: bound.Name, UID: bound.UID}
			}
		}
		if err == nil {
			token, err = client.CoreV1().ServiceAccounts(*namespace).CreateToken(context.Background(), *name, request, metav1.CreateOptions{})
		}
		if err == nil || attempt == 50 {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("token for %s/%s: %w", *namespace, *name, err)
	}
	ca, err := os.ReadFile(config.TLSClientConfig.CAFile)
	if err != nil && len(config.TLSClientConfig.CAData) == 0 {
		return err
	}
	if len(config.TLSClientConfig.CAData) > 0 {
		ca = config.TLSClientConfig.CAData
	}
	return writeKubeconfig(*out, &clientcmdapi.Cluster{Server: config.Host, CertificateAuthorityData: ca},
		&clientcmdapi.AuthInfo{Token: token.Status.Token})
}

// writeKubeconfig writes a one-context kubeconfig: this cluster, these
// credentials.
// clientFor: a client with the identity of kubeconfig, and its config.
func clientFor(kubeconfig string) (*rest.Config, *kubernetes.Clientset, error) {
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	client, err := kubernetes.NewForConfig(config)
	return config, client, err
}

func writeKubeconfig(path string, cluster *clientcmdapi.Cluster, auth *clientcmdapi.AuthInfo) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["peers"] = cluster
	cfg.AuthInfos["peers"] = auth
	cfg.Contexts["peers"] = &clientcmdapi.Context{Cluster: "peers", AuthInfo: "peers"}
	cfg.CurrentContext = "peers"
	return clientcmd.WriteToFile(*cfg, path)
}
