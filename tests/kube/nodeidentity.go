package main

// Node identities: the control plane trusts a client CA of its own, and
// node-kubeconfig signs a certificate for system:node:<name> in the group
// system:nodes with it, so the kubelet peer goes through the Node
// authorizer and the NodeRestriction admission plugin as a kubelet does.

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"
)

const (
	clientCACert = "client-ca.crt"
	clientCAKey  = "client-ca.key"
)

// writeClientCA makes the CA the API server trusts for client certificates.
func writeClientCA(dir string) (string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	ca, err := certutil.NewSelfSignedCACert(certutil.Config{CommonName: "kube-peers-client-ca"}, key)
	if err != nil {
		return "", err
	}
	keyPEM, err := keyutil.MarshalPrivateKeyToPEM(key)
	if err != nil {
		return "", err
	}
	certPath := filepath.Join(dir, clientCACert)
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Raw}), 0o600); err != nil {
		return "", err
	}
	return certPath, os.WriteFile(filepath.Join(dir, clientCAKey), keyPEM, 0o600)
}

func runNodeKubeconfig(args []string) error {
	fs := flag.NewFlagSet("node-kubeconfig", flag.ContinueOnError)
	dir := fs.String("dir", "", "the control plane's state directory")
	node := fs.String("node", "", "node name")
	out := fs.String("out", "", "where to write the kubeconfig")
	if err := fs.Parse(args); err != nil {
		return err
	}
	caCerts, err := certutil.CertsFromFile(filepath.Join(*dir, clientCACert))
	if err != nil {
		return err
	}
	caKey, err := keyutil.PrivateKeyFromFile(filepath.Join(*dir, clientCAKey))
	if err != nil {
		return err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return err
	}
	template := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "system:node:" + *node, Organization: []string{"system:nodes"}},
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	signer, ok := caKey.(crypto.Signer)
	if !ok {
		return fmt.Errorf("the client CA key cannot sign")
	}
	der, err := x509.CreateCertificate(rand.Reader, template, caCerts[0], &key.PublicKey, signer)
	if err != nil {
		return err
	}
	keyPEM, err := keyutil.MarshalPrivateKeyToPEM(key)
	if err != nil {
		return err
	}
	admin, err := clientcmd.LoadFromFile(filepath.Join(*dir, "admin.kubeconfig"))
	if err != nil {
		return err
	}
	return writeKubeconfig(*out, admin.Clusters[admin.Contexts[admin.CurrentContext].Cluster], &clientcmdapi.AuthInfo{
		ClientCertificateData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		ClientKeyData:         keyPEM,
	})
}
